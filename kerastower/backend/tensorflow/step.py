"""The compiled tower step on TensorFlow: one batch per tower per step.

One step of N towers:

1. each tower takes its own batch (`feeding.next_step`) and runs the tower
   step (`train_step`, `test_step`, `predict_step`) under its TowerContext,
   which carries the tower's example count and its share `n_i / sum_j n_j`;
2. the tower computes the gradient of ITS OWN mean loss, as on one device
   (Keras's losses are not divided by N inside a tower);
3. `optimizer.apply(gradients)` inside a tower (any optimizer, also in a
   custom `train_step`) weights them by the tower's share, sums them over
   towers (sparse gradients stay sparse), and only then lets the optimizer
   clip, check for non-finite values and apply: the update is that of one
   device on the joined batch (gradients.py: where gradients are
   reduced);
4. the towers' replica-local weights (BatchNormalization statistics) follow
   the main tower, and the logs are the metrics read across towers.
"""

import collections
import contextlib
import functools
import weakref

import numpy as np
import tensorflow as tf

from kerastower import _compat
from kerastower.backend.tensorflow import collectives
from kerastower.backend.tensorflow import feeding
from kerastower.backend.tensorflow import gradients
from kerastower.backend.tensorflow import nonfinite
from kerastower.backend.tensorflow import xla
from kerastower.backend.step_values import is_own_step
from kerastower.backend.tensorflow.step_values import StepValues
from kerastower.backend.tensorflow import step_errors
from kerastower import loss_divisors
from kerastower.errors import PeerFailureError
from kerastower.errors import TowerRuleError
from kerastower.tower import TowerContext
from kerastower.tower import forbid_variable_creation
from kerastower.tower import get_current_tower_context

__all__ = [
    "StepsRun",
    "num_examples",
    "tower_scope",
    "make_step_function",
    "run_steps",
]


def num_examples(data):
    """The batch size of one tower's batch, as an int32 scalar tensor."""
    x, _, _ = _compat.unpack_x_y_sample_weight(data)
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    return tf.shape(first)[0]


StepsRun = collections.namedtuple(
    "StepsRun", ["steps", "examples", "tower_examples", "tower_batches", "logs", "nonfinite_towers",
                 "final_logs"], defaults=[None])
StepsRun.__doc__ = """What one call of a step function did: steps run, examples
over all towers, the last step's examples per tower, batches each tower took,
the logs (predictions, for predict), and None, or when the last step's
gradients were not finite (its update skipped), the indices of this
process's towers whose own gradients were not; then None, or the logs the
end of an epoch takes instead (`StepRun.final_logs`)."""


# -- the tower scope -------------------------------------------------------------

@contextlib.contextmanager
def tower_scope(model, is_training, step_name, name=None, examples=None, equal_batches=False,
                batch_size=None):
    """Inside a tower: its TowerContext, the tower rules, and (in training)
    the towers' replica-local weights following the main tower's after it.

    `examples` (this tower's batch size) gives the context its share of the
    step's examples; without it, or with `equal_batches` (every tower's
    batch has the same static size), each tower's share is 1/N.
    `batch_size` (default: `examples`) is the context's, in every mode.
    """
    strategy = model.tower_strategy
    ctx = TowerContext(strategy.tower_index(), strategy.num_towers, is_training, name=name)
    ctx.strategy = strategy
    ctx.num_examples = examples
    ctx.batch_size = examples if batch_size is None else batch_size
    if strategy.num_towers > 1 or not strategy.single_process:
        ctx.sum_over_towers = lambda value: strategy.all_reduce_sum([value])[0]
    ctx.check_finite = getattr(model, "tower_check_finite", True)
    ctx.gradient_presence = model.engine.cache.gradient_presence
    if examples is None or equal_batches:
        ctx.example_weight = tf.constant(1.0 / ctx.total)
    elif ctx.total == 1:
        ctx.example_weight = tf.constant(1.0)
    else:
        n = tf.cast(examples, tf.float32)
        ctx.defer_example_weight(
            lambda: tf.math.divide_no_nan(n, strategy.all_reduce_sum([n])[0]))
    with gradients.TOWER_PATCHES, loss_divisors.MASKED_LOSSES, ctx, \
            tf.summary.record_if(ctx.is_main_tower), forbid_variable_creation(step_name):
        kept = _kept_for_a_nonfinite_step(model, ctx) if is_training else None
        yield ctx
        if kept is not None:
            _put_back_unless_finite(ctx, kept)
        if is_training:
            _follow_main_tower(model, ctx)


def _replica_local_weights(model):
    """Non-trainable weights each tower updates on its own copy (e.g.
    BatchNormalization's moving statistics), except those of frozen layers
    and of layers that synchronize across towers themselves."""
    cache = model.engine.cache
    if cache.local_weights is None:
        skip = {
            id(weight)
            for layer in _compat.flatten_layers(model)
            if not layer.trainable or getattr(layer, "synchronized", False)
            for weight in layer.weights
        }
        cache.local_weights = [
            weight for weight in model.non_trainable_weights
            if weight.aggregation == "none" and id(weight) not in skip
        ]
    return cache.local_weights


def _kept_for_a_nonfinite_step(model, ctx):
    """What a training tower's forward pass changes besides the update
    (BatchNormalization's statistics, the metrics), with its values before
    the step: a step whose gradients are not finite applies no update, and
    must leave these as they were too (JAX's step does the same)."""
    if not ctx.check_finite:
        return None
    variables = _replica_local_weights(model) + list(model.metrics_variables)
    return [(v, tf.identity(v.value)) for v in variables]


def _put_back_unless_finite(ctx, kept):
    flags = getattr(ctx, "nonfinite_flags", None)
    if flags is None:  # the step applied no gradients
        return

    def put_back():
        for variable, before in kept:
            variable.assign(before)
        return tf.constant(True)

    # A cond: a finite step, the common one, runs no assignment.
    tf.cond(flags[0], lambda: tf.constant(True), put_back)


def _follow_main_tower(model, ctx):
    weights = _replica_local_weights(model)
    if ctx.total == 1 or not weights:
        return
    shares = [w.value if ctx.is_main_tower else tf.zeros_like(w.value) for w in weights]
    for weight, value in zip(weights, model.tower_strategy.all_reduce_sum(shares)):
        weight.assign(value)


def seed_towers_apart(model):
    """Gives every tower its own random stream: tower i's seed generators
    start from tower 0's state with the seed moved by i (else every tower's
    Dropout draws the same mask). Tower 0, what is saved, keeps its stream."""
    if model.num_towers == 1:
        return
    for layer in _compat.flatten_layers(model):
        for generator in _compat.seed_generators(layer):
            model.tower_strategy.assign_per_tower(
                generator.state.value,
                lambda index, main: main + tf.constant([index * 1_000_003, 0], main.dtype),
            )


# -- step functions --------------------------------------------------------------

def _top_level_names():
    """The tower step's names (and a `tf.summary`'s tags) as in Keras's own
    step, without the step loop's `while/` and `cond/` scopes. A tower's
    own `replica_<k>/` scope stays: TensorFlow's errors name the tower by it
    (step_errors.py)."""
    graph = tf.compat.v1.get_default_graph()
    tower = [part for part in graph.get_name_scope().split("/") if part.startswith("replica_")]
    return graph.name_scope("/".join(tower) + "/" if tower else "")


def _run_unless_empty(test_step, data, examples, values):
    """`test_step(data)`'s values (`StepValues.local`) unless the batch is
    empty (an empty batch would add zero losses with a count of one to
    Keras's per-output loss trackers)."""
    found = []

    def run():
        with _top_level_names():
            outputs = test_step(data)
        local = values.local(outputs, examples)
        found.append(local is not None)
        return values.idle() if local is None else local

    model = values.model
    if model is not None and model.engine.cache.forward_collectives:
        return run()
    try:
        with loss_divisors.without_collectives():
            local = tf.cond(examples > 0, run, values.idle)
    except loss_divisors.ForwardCollectiveNeeded:
        # A masked loss all-reduces its divisor: every tower runs the step
        # (an empty batch's loss is weighted zero by its divisor).
        if model is not None:
            model.engine.cache.forward_collectives = True
        found.clear()
        return run()
    return local if found and found[0] else None


def make_step_function(model, tower_step, mode):
    """A function `f(iterator, num_steps, endless=False)` running up to
    `num_steps` steps (a tensor; the Python int 1 with `endless` runs one
    step without the step loop).

    It returns (steps run, examples seen, last step's examples per tower,
    batches each tower took, logs). Training and evaluation stop early,
    without error, when the input runs out; their logs are the model's
    metrics read across towers. Prediction runs one step and returns the
    outputs concatenated in tower order.
    """
    strategy = model.tower_strategy
    is_training = mode == "train"
    step_name = f"{type(model).__name__}.{tower_step.__name__}"
    own_step = is_own_step(model, tower_step.__name__)
    if xla.whole_step(model, mode) and getattr(model, "tower_jit_compile", False):
        tower_step = _compiled_whole(model, tower_step)
    # What a step may return: its metrics' results, flat or by metric name
    # (keras.io's `{m.name: m.result() for m in self.metrics}`).
    metric_keys = (
        set(model.get_metrics_result()) | {m.name for m in model.metrics}
        if mode != "predict" else set()
    )

    values = StepValues(metric_keys, step_name, model=model,
                        own_step=own_step)

    def tower_fn(data, equal_batches):
        index = strategy.tower_index()
        name = f"predict_tower{index}" if mode == "predict" else None
        examples = num_examples(data)
        local = None
        with tower_scope(model, is_training, step_name, name=name,
                         examples=examples if is_training else None,
                         equal_batches=equal_batches, batch_size=examples) as ctx:
            if mode == "test" and ctx.total > 1:
                local = _run_unless_empty(tower_step, data, examples, values)
            else:
                with _top_level_names():
                    outputs = tower_step(data)
                if mode != "predict":
                    local = values.local(outputs, examples)
        if mode != "predict":
            # The logs are the metrics read across towers and the values the
            # step returned, reduced over the towers (step_values.py).
            outputs = None if local is None else values.reduced(local, strategy)
        return outputs, examples, nonfinite.tower_health(ctx), getattr(ctx, "reduced_counts", None)

    def run_towers(data):
        equal = strategy.single_process and _static_equal_batches(strategy, data)
        outputs, examples, health, counts = strategy.run(tower_fn, args=(data, equal))
        if is_training or strategy.single_process:
            return outputs, strategy.step_examples(examples, counts), health
        # Evaluation needs no count per tower: none is gathered across processes.
        return outputs, tf.zeros([strategy.num_towers], tf.int32), health

    def predict_function(data):
        outputs, _, _ = run_towers(data)
        return tf.nest.map_structure(strategy.concat_tower_outputs, outputs)

    def function(iterator, num_steps, endless=False):
        if endless and isinstance(num_steps, int) and num_steps == 1:
            # One step of an endless input (`run_steps` passes the Python
            # int 1) runs straight, without the loop: the loop's frames
            # cost about 0.2 ms a call, 8% of a small MLP's step on a
            # 2-core CPU.
            reduced, tower_examples, per_tower = run_towers(iterator.get_next())
            finite, bad_towers = nonfinite.step_health(strategy, per_tower)
            step_values = (tf.zeros([0], tf.float32) if reduced is None
                           else strategy.tower_values(reduced)[0])
            return results(tf.constant(1), tf.reduce_sum(tower_examples), tower_examples,
                           tf.cast(tower_examples > 0, tf.int32), finite, bad_towers, step_values)
        steps = tf.constant(0)
        examples = tf.constant(0)
        tower_examples = tf.zeros([strategy.num_towers], tf.int32)
        tower_batches = tf.zeros([strategy.num_towers], tf.int32)
        finite = tf.constant(True)
        bad_towers = tf.zeros([strategy.num_towers], tf.int32)
        step_values = tf.zeros([0], tf.float32)   # the last step's returned values
        # An optional tells "no data left for any tower" (stop) from a last
        # step where only some towers got a batch (run it).
        for _ in tf.range(num_steps):
            tf.autograph.experimental.set_loop_options(
                shape_invariants=[(step_values, tf.TensorShape([None]))])
            has_data, next_batches = feeding.next_step(strategy, iterator, endless)
            if not has_data:
                break
            reduced, tower_examples, per_tower = run_towers(next_batches())
            if reduced is not None:
                step_values = strategy.tower_values(reduced)[0]
            examples += tf.reduce_sum(tower_examples)
            tower_batches += tf.cast(tower_examples > 0, tf.int32)
            steps += 1
            finite, bad_towers = nonfinite.step_health(strategy, per_tower)
            if not finite:
                break
        return results(steps, examples, tower_examples, tower_batches, finite, bad_towers, step_values)

    def results(steps, examples, tower_examples, tower_batches, finite, bad_towers, step_values):
        """What a step function returns: (counters, logs) or (counters,
        logs, final logs)."""
        # Metrics read across towers sum every tower's totals and counts:
        # the logs are example-weighted over towers. Where towers span
        # processes that is a collective: the steps give this process's
        # metrics, and the loops read them across towers when they log
        # (`logs_across_towers`).
        with collectives.phase("logs"):
            logs = (strategy.metrics_result(model) if strategy.single_process
                    else strategy.local_metrics_result(model))
        final = values.final_logs(logs)
        logs = values.logs(logs, step_values)
        # One vector, read back in one transfer.
        counters = tf.concat([
            tf.stack([steps, examples, tf.cast(finite, tf.int32)]),
            tower_examples, tower_batches, bad_towers], axis=0)
        return (counters, logs) if final is None else (counters, logs, final)

    step_function = predict_function if mode == "predict" else function
    recorded = _recording_collectives(model, mode, step_function)
    if not model.run_eagerly:
        return tf.function(recorded, reduce_retracing=True)
    return recorded


def _compiled_whole(model, tower_step):
    """`tower_step` compiled with XLA, handing out what it noted on the
    tower's context (tensors of the compiled function's graph)."""
    def run(data):
        outputs = tower_step(data)
        ctx = get_current_tower_context()
        return outputs, getattr(ctx, "nonfinite_flags", None)

    compiled = xla.compiled(model, run)

    def step(data):
        outputs, flags = compiled(data)
        if flags is not None:
            get_current_tower_context().nonfinite_flags = flags
        return outputs

    step.__name__ = tower_step.__name__
    return step


def _recording_collectives(model, mode, step_function):
    def traced(*args):
        with collectives.recording(model, mode):
            return step_function(*args)

    return traced


def _static_equal_batches(strategy, data):
    """Whether every tower's batch of this step has the same static size
    (known when the step is traced, e.g. a repeated pipeline): then each
    tower's share is 1/N and no example count needs reducing."""
    sizes = set()
    for tower_data in strategy.tower_values(data):
        x, _, _ = _compat.unpack_x_y_sample_weight(tower_data)
        first = next(t for t in tf.nest.flatten(x) if t is not None)
        sizes.add(tf.compat.dimension_value(first.shape[0]) if first.shape.rank else None)
    return len(sizes) == 1 and None not in sizes and 0 not in sizes


def logs_across_towers(model):
    """The model's metrics read across all towers and processes, outside
    any step: what an epoch's (or an evaluation's) logs say."""
    cache = model.engine.cache
    if cache.read_logs is None:
        def read():
            with collectives.recording(model, "read_logs"):
                return model.tower_strategy.metrics_result(model)

        cache.read_logs = read if model.run_eagerly else tf.function(read)
    return cache.read_logs()


def run_steps(function, iterator, num_steps, what="step", endless=False, failures=None,
              one_step_calls=False):
    """Runs up to `num_steps` steps of a step function; returns a StepsRun.

    `what` names the steps in errors (e.g. "Training step 12"); `endless`
    says that no tower's input can run out (see `TowerStrategy.next_step`);
    `failures` is the run's StepFailures, whose generator error a failed
    step names (step_errors.py); `one_step_calls` says that every call runs
    one step (`steps_per_execution=1`)."""
    try:
        # Calls of one step from an endless input pass the Python int 1,
        # which the step function runs without its loop. Only where every
        # call is of one step: an epoch's last, shorter call of
        # `steps_per_execution=k` reuses the loop's trace (a second trace
        # of a large model, or its XLA compilation, costs seconds).
        straight = endless and one_step_calls and num_steps == 1
        steps_arg = 1 if straight else _as_tensor(num_steps)
        counters, outputs, *final = _call(function, iterator, steps_arg, endless)
    except tf.errors.OutOfRangeError:
        return StepsRun(0, 0, None, 0, None, None)
    except tf.errors.UnavailableError as error:
        raise PeerFailureError(
            "Another worker of this training stopped responding (it died or "
            "lost its network), so the collective step was aborted. Restart "
            "all workers; with kt.callbacks.AutoResume they go on from the "
            f"last checkpoint. TensorFlow said: {error.message.splitlines()[0]}"
        ) from error
    except tf.errors.OpError as error:
        failure = step_errors.explain(error, what, failures)
        raise failure from failure.__cause__
    counters = counters.numpy().tolist()
    steps, examples, finite = counters[:3]
    towers = (len(counters) - 3) // 3
    tower_examples, tower_batches, bad_towers = (
        counters[3 + k * towers:3 + (k + 1) * towers] for k in range(3))
    return StepsRun(
        steps, examples, tower_examples, tower_batches, outputs,
        None if finite else [i for i, bad in enumerate(bad_towers) if bad], final[0] if final else None,
    )


# Per iterator (held weakly: the input's end comes with its iterator's), the
# step calls bound to it: {(function, num_steps (an int, or a tensor's ref), endless): call}.
_bound_calls = weakref.WeakKeyDictionary()


def _call(function, iterator, num_steps, endless):
    """`function(iterator, num_steps, endless)`, through the concrete
    function traced for this iterator with its arguments bound once: a
    tf.function's dispatch and a concrete function's argument binding cost
    0.3 ms and 0.4 ms a call on a 2-core CPU."""
    if not hasattr(function, "get_concrete_function"):  # run_eagerly
        return function(iterator, num_steps, endless)
    calls = _bound_calls.setdefault(iterator, {})
    key = (function, num_steps if isinstance(num_steps, int) else num_steps.ref(), endless)
    call = calls.get(key)
    if call is None:
        concrete = traced(function, iterator, num_steps, endless)
        call = calls[key] = _compat.bound_call(concrete, (iterator, num_steps, endless))
    return call()


def traced(function, *args):
    """`function.get_concrete_function(*args)`, building every optimizer
    the step uses for the first time outside the towers, then tracing the
    step again (gradients.OptimizerFirstUse)."""
    built = set()
    gradients._first_uses.clear()
    gradients._retrying[0] += 1
    try:
        while True:
            try:
                return function.get_concrete_function(*args)
            except gradients.OptimizerFirstUse:
                new = gradients.build_first_used()
                if not new:
                    raise
                if any(id(o) in built for o in new) or len(built) > 64:
                    raise TowerRuleError(
                        f"The optimizer {new[0].name!r} is used for the first time at every "
                        "trace of the step, even after it was built: its build() does not "
                        "mark it built, or the step makes a new optimizer each time. Make "
                        "the optimizer once (in __init__ or compile) and build it there.")
                built.update(id(o) for o in new)
    finally:
        gradients._retrying[0] -= 1
        gradients._first_uses.clear()


@functools.lru_cache(maxsize=64)
def _as_tensor(num_steps):
    # Made once per value: a new constant every call costs as much as a
    # small step's work.
    return tf.constant(num_steps)
