"""Calling a TensorFlow step function: what one call ran, and its fast path.

`run_steps` calls a step function (step.py) for up to `num_steps` steps and
reads back what it did as a `StepsRun`, turning TensorFlow's errors into
kerastower's (step_errors.py). Each iterator's call is traced once, its
arguments bound (`_call`), and every optimizer first used inside the step is
built outside it before the trace is taken again (`traced`).
`logs_across_towers` reads the metrics across towers outside any step.
"""

import collections
import functools
import weakref

import tensorflow as tf

from kerastower import _compat
from kerastower.backend.tensorflow import collectives
from kerastower.backend.tensorflow import gradients
from kerastower.backend.tensorflow import step_errors
from kerastower.errors import PeerFailureError
from kerastower.errors import TowerRuleError

__all__ = ["StepsRun", "run_steps", "run_predict_step", "logs_across_towers", "traced"]


StepsRun = collections.namedtuple(
    "StepsRun", ["steps", "examples", "tower_examples", "tower_batches", "logs", "nonfinite_towers",
                 "final_logs"], defaults=[None])
StepsRun.__doc__ = """What one call of a step function did: steps run, examples
over all towers, the last step's examples per tower, batches each tower took,
the logs (predictions, for predict), and None, or when the last step's
gradients were not finite (its update skipped), the indices of this
process's towers whose own gradients were not; then None, or the logs the
end of an epoch takes instead (`StepRun.final_logs`)."""


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


def run_predict_step(function, iterator, what="Prediction step", failures=None):
    """One prediction step of `function` (a step function's
    `from_iterator`) on an iterator whose every step fills every tower;
    its outputs, or None where the input has ended."""
    try:
        return _call(function, iterator, 1, True)
    except tf.errors.OutOfRangeError:
        return None
    except tf.errors.OpError as error:
        failure = step_errors.explain(error, what, failures)
        raise failure from failure.__cause__


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
