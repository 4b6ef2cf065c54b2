"""Non-finite steps: a NaN or Inf gradient on any tower ends training.

Inside a training tower, `optimizer.apply` checks the reduced gradients.
When any value is NaN or Inf (a non-finite loss makes its gradients
non-finite), the update is skipped on every tower, the step function stops
after that step, and the loop raises `NonFiniteError` naming the step and
the towers whose own gradients were not finite. The weights stay those of
the last good step, so nothing non-finite reaches a checkpoint.

`keras.optimizers.LossScaleOptimizer` is left alone: it skips such a step
itself, lowers its loss scale and goes on (the loop counts the step).
"""

from kerastower._tf import tf
from kerastower.errors import nonfinite_error

__all__ = [
    "all_finite", "record", "tower_health", "step_health", "error_for",
]


def all_finite(tensors):
    """Whether every value of `tensors` (dense or IndexedSlices) is finite."""
    values = [t.values if isinstance(t, tf.IndexedSlices) else t for t in tensors]
    if not values:
        return tf.constant(True)
    # A sum is NaN or Inf when a term is, and reads each tensor once (half
    # the memory traffic of is_finite's mask): the common, finite, case
    # costs that only. A sum can also overflow to Inf from huge finite
    # terms, so a sum that is not finite is confirmed value by value.
    sums = tf.stack([tf.reduce_sum(tf.cast(v, tf.float32)) for v in values])
    return tf.cond(
        tf.reduce_all(tf.math.is_finite(sums)),
        lambda: tf.constant(True),
        lambda: tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values])),
    )


def record(ctx, step_finite, tower_gradients):
    """Notes on the tower's context whether the step's reduced gradients
    (`step_finite`) and the tower's own (weighted) ones were finite. The
    tower's own are only checked when the step's were not."""
    if ctx.total == 1:  # the tower's gradients are the step's
        own = step_finite
    else:
        own = tf.cond(step_finite, lambda: tf.constant(True), lambda: all_finite(tower_gradients))
    previous = getattr(ctx, "nonfinite_flags", None)
    if previous is not None:
        step_finite = tf.logical_and(previous[0], step_finite)
        own = tf.logical_and(previous[1], own)
    ctx.nonfinite_flags = (step_finite, own)


def tower_health(ctx):
    """(tower index, step finite, this tower's gradients finite) for a tower
    that has run its step: finite when it applied no gradients."""
    flags = getattr(ctx, "nonfinite_flags", None)
    if flags is None:
        flags = (tf.constant(True), tf.constant(True))
    return (tf.constant(ctx.index),) + tuple(flags)


def step_health(strategy, per_tower):
    """(step finite, int32 vector by tower index: 1 where this process's
    tower had non-finite gradients), from the towers' `tower_health`
    results (with their indices) as `strategy.run` returned them. Reads
    this process's towers only: no collective is spent on it."""
    index, step_finite, own_finite = (tf.stack(strategy.tower_values(v)) for v in per_tower)
    bad_towers = tf.scatter_nd(
        index[:, None], tf.cast(tf.logical_not(own_finite), tf.int32), [strategy.num_towers]
    )
    return tf.reduce_all(step_finite), bad_towers


# The error is backend-neutral (the JAX engine raises it too).
error_for = nonfinite_error
