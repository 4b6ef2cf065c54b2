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

import tensorflow as tf

from kerastower import _compat
from kerastower import loss_divisors
from kerastower.backend.step_values import is_own_step
from kerastower.backend.tensorflow import collectives
from kerastower.backend.tensorflow import feeding
from kerastower.backend.tensorflow import nonfinite
from kerastower.backend.tensorflow import xla
from kerastower.backend.tensorflow.step_values import StepValues
from kerastower.backend.tensorflow.tower_scope import tower_scope
from kerastower.tower import get_current_tower_context

__all__ = ["num_examples", "make_step_function"]


def num_examples(data):
    """The batch size of one tower's batch, as an int32 scalar tensor."""
    x, _, _ = _compat.unpack_x_y_sample_weight(data)
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    return tf.shape(first)[0]


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

    def one_step(batches, step_values):
        """Runs the towers on one step's batches: (examples per tower,
        finite, towers with non-finite gradients, the step's returned
        values, or `step_values` where it returned none)."""
        reduced, tower_examples, per_tower = run_towers(batches)
        finite, bad_towers = nonfinite.step_health(strategy, per_tower)
        if reduced is not None:
            step_values = strategy.tower_values(reduced)[0]
        return tower_examples, finite, bad_towers, step_values

    def function(iterator, num_steps, endless=False):
        if endless and isinstance(num_steps, int) and num_steps == 1:
            # One step of an endless input (`run_steps` passes the Python
            # int 1) runs straight, without the loop: the loop's frames
            # cost about 0.2 ms a call, 8% of a small MLP's step on a
            # 2-core CPU.
            tower_examples, finite, bad_towers, step_values = one_step(
                iterator.get_next(), tf.zeros([0], tf.float32))
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
            tower_examples, finite, bad_towers, step_values = one_step(next_batches(), step_values)
            examples += tf.reduce_sum(tower_examples)
            tower_batches += tf.cast(tower_examples > 0, tf.int32)
            steps += 1
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

    def predict_next(iterator, num_steps, endless):
        # `num_steps` (1) and `endless` (True) only key the bound call
        # (step_calls.py): the step takes its batches without asking
        # whether any is left.
        return predict_function(iterator.get_next())

    step_function = predict_function if mode == "predict" else function
    recorded = _recording_collectives(model, mode, step_function)
    if model.run_eagerly:
        return recorded
    compiled = tf.function(recorded, reduce_retracing=True)
    if mode == "predict":
        # Where every step fills every tower, one call takes the step's
        # batches and predicts (`TensorFlowEngine.predict_step`).
        compiled.from_iterator = tf.function(_recording_collectives(model, mode, predict_next))
    return compiled


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
