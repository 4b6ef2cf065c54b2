"""Where gradients are reduced: each tower's weighted, summed over towers,
then applied once.

Inside a training tower, Keras's `optimizer.apply` (patched by
`TOWER_PATCHES` while a tower is traced or run, see `_compat.tower_patches`)
calls `apply_in_tower`, which:

1. weights the tower's gradients by its share of the step's examples,
   `n_i / sum_j n_j` (when the counts are not known in advance, each tower
   adds `n_i * g_i` and `n_i` in the same all-reduce and divides after);
2. sums them over towers in one all-reduce (sparse gradients stay sparse,
   each index then summed into one slice: `_duplicates_summed`);
3. checks the sums for NaN/Inf and lets the optimizer clip and apply them,
   on every tower alike: the update of one device on the joined batch.
"""

import threading

import keras
import tensorflow as tf

from kerastower import _compat
from kerastower import loss_divisors
from kerastower.backend.tensorflow import nonfinite
from kerastower.errors import TowerRuleError
from kerastower.tower import get_current_tower_context

__all__ = ["apply_in_tower", "gradients_unless_empty", "reduce_tower_gradients", "GradientPresence"]


class GradientPresence:
    """Which variables got a gradient on each tower of the step being
    traced: a variable without one on every tower is left out of the
    update, as one device leaves it out. Towers are traced in threads, so
    it is shared, behind a lock; one per model (its engine's StepCache),
    reached from a tower through its TowerContext."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_key = {}

    def record(self, key, tower, flags):
        with self._lock:
            self._by_key.setdefault(key, {})[tower] = flags

    def seen(self, key):
        with self._lock:
            return list(self._by_key[key].values())


def _weighted(gradient, variable, weight):
    if gradient is None:
        return tf.zeros(variable.shape, variable.dtype)
    # multiply_no_nan: a tower without examples (weight 0) adds exact zeros,
    # even where its empty batch made the loss NaN.
    if isinstance(gradient, tf.IndexedSlices):
        values = tf.math.multiply_no_nan(gradient.values, tf.cast(weight, gradient.values.dtype))
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return tf.math.multiply_no_nan(gradient, tf.cast(weight, gradient.dtype))


def reduce_tower_gradients(strategy, ctx, gradients, weighted, key, extra=()):
    """The sum over towers of each variable's `weighted` gradient; None for a
    variable no tower has a gradient for (`gradients` is None). `extra`
    tensors ride along in the same all-reduce; returns (sums, extra sums)."""
    ctx.gradient_presence.record(key, ctx.index, [g is not None for g in gradients])
    reduced = strategy.all_reduce_sum(list(weighted) + list(extra))
    reduced, extra = reduced[:len(weighted)], reduced[len(weighted):]
    # Every tower of this process has recorded its gradients by now: the
    # all-reduce above waited for all of them.
    seen = ctx.gradient_presence.seen(key)
    return [r if any(p[i] for p in seen) else None for i, r in enumerate(reduced)], extra


def _divided(gradient, total):
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        values = tf.math.divide_no_nan(gradient.values, tf.cast(total, gradient.values.dtype))
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return tf.math.divide_no_nan(gradient, tf.cast(total, gradient.dtype))


def _example_weighted_sum(ctx, gradients, variables, key):
    """(the example-weighted mean over towers of each gradient, this tower's
    weighted gradients). With the example counts not known in advance, each
    tower adds `n_i * g_i` and its count in ONE all-reduce, then divides by
    the total: no separate all-reduce of the counts."""
    if ctx.total == 1:  # one tower: its gradients are the step's
        present = [g for g in gradients if g is not None]
        return list(gradients), present
    if not ctx.example_weight_deferred:
        weighted = [_weighted(g, v, ctx.example_weight) for g, v in zip(gradients, variables)]
        reduced, _ = reduce_tower_gradients(ctx.strategy, ctx, gradients, weighted, key)
        return reduced, weighted
    count = tf.cast(ctx.num_examples, tf.float32)
    weighted = [_weighted(g, v, count) for g, v in zip(gradients, variables)]
    counts = tf.one_hot(ctx.index, ctx.total, dtype=tf.float32) * count
    reduced, (counts,) = reduce_tower_gradients(
        ctx.strategy, ctx, gradients, weighted, key, extra=[counts])
    if getattr(ctx, "reduced_counts", None) is None:
        ctx.reduced_counts = counts
    total = tf.reduce_sum(counts)
    return [_divided(r, total) for r in reduced], weighted


class OptimizerFirstUse(Exception):
    """Raised while a step is traced by `step_calls.traced`, where an optimizer is
    first used inside a tower (noted in `_first_uses`): `traced` builds it
    outside the towers, on the variables it was asked to update
    (`build_first_used`), and traces the step again. So every optimizer
    builds on first use, as in stock Keras, with its slots made once, not
    once per tower. The note lives beside the exception because autograph
    re-raises an exception as a copy made from its message."""


# (optimizer, variables, strategy) of each optimizer first used in the
# trace `step_calls.traced` is making (`_retrying` > 0 while it does): the trace
# is synchronous, and the towers' threads share the list.
_first_uses = []
_retrying = [0]


def _unbuilt_optimizer_error(optimizer, why):
    return TowerRuleError(
        f"The optimizer {optimizer.name!r} was first used inside a tower step {why}, "
        "where it would create its slot variables once per tower. Build it before "
        "training, on the variables it updates: e.g. after compile(), "
        "`second_optimizer.build(model.<part>.trainable_variables)`. (fit's steps "
        "build each optimizer outside the towers on its first use.)"
    )


def _build_at_first_use(optimizer, variables, strategy):
    """An optimizer used for the first time inside a tower: built outside
    the towers, once, before any tower goes on (see OptimizerFirstUse)."""
    if variables is None:
        raise _unbuilt_optimizer_error(optimizer, "without the variables it updates")
    variables = list(variables)
    if not tf.inside_function():
        # Run eagerly: the towers meet in a merge_call, where the optimizer
        # is built once, across towers, as stock Keras builds it.
        def build(distribution):
            with distribution.scope():
                optimizer.build(variables)

        tf.distribute.get_replica_context().merge_call(build)
        return
    if not _retrying[0]:
        raise _unbuilt_optimizer_error(optimizer, "traced outside fit's steps")
    if all(optimizer is not noted for noted, _, _ in _first_uses):
        _first_uses.append((optimizer, variables, strategy))
    raise OptimizerFirstUse(f"the optimizer {optimizer.name!r} is used for the first time")


def build_first_used():
    """Builds, outside the towers, every optimizer the last trace used for
    the first time; returns the optimizers it built."""
    noted = list(_first_uses)
    _first_uses.clear()
    built = []
    for optimizer, variables, strategy in noted:
        if not optimizer.built:
            with strategy.scope():
                optimizer.build(variables)
            built.append(optimizer)
    return built


def apply_in_tower(optimizer, keras_apply, gradients, variables=None):
    """`optimizer.apply` inside a training tower: reduce, then Keras's apply.

    Put into Keras's optimizers by `TOWER_PATCHES` while a tower runs.
    """
    ctx = get_current_tower_context()
    if not optimizer.built:
        _build_at_first_use(optimizer, variables, ctx.strategy)
    variables = list(_compat.optimizer_variables(optimizer) if variables is None else variables)
    gradients = list(gradients)
    if not gradients and not variables:
        return  # as Keras: nothing to update (a model without trainable weights)
    if len(gradients) != len(variables):
        raise ValueError(
            f"optimizer.apply got {len(gradients)} gradients for {len(variables)} variables."
        )
    key = (id(optimizer), tuple(id(v) for v in variables))
    reduced, weighted = _example_weighted_sum(ctx, gradients, variables, key)
    pairs = [(g, v) for g, v in zip(reduced, variables) if g is not None]
    if not pairs:
        raise ValueError(
            "No gradients provided for any variable (Keras's error): no gradient "
            "reached any variable the optimizer updates. Does the loss depend on "
            f"them? Variables: {[v.path for v in variables]}"
        )
    reduced = [_duplicates_summed(g) for g, _ in pairs]
    variables = [v for _, v in pairs]
    with _compat.gradients_already_reduced():
        if _compat.accumulation_steps(optimizer) and not isinstance(
                optimizer, keras.optimizers.LossScaleOptimizer):  # fit refuses that one
            # Keras's accumulation, its k-th step taken where the strategy
            # can update (the towers' gradients are one already: k steps
            # of N x B examples accumulate the mean over k x N x B).
            finite = nonfinite.all_finite(reduced) if ctx.check_finite else None
            if finite is not None:
                nonfinite.record(ctx, finite, weighted)
            count = loss_divisors.step_loss_count(ctx, warn=True)
            assign = ()
            if count is not None and _compat.loss_count_variable(optimizer) is not None:
                # A token-normalised loss: micro-steps weighed by their tokens.
                reduced, counts = _compat.count_weighted(optimizer, reduced, variables, count)
                assign = [(_compat.loss_count_variable(optimizer), counts),
                          *_cycle_logged(ctx, optimizer, count)]
            _compat.accumulate_or_apply(optimizer, lambda grads: keras_apply(optimizer, grads, variables),
                                        reduced, variables, finite, assign)
            return
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or not ctx.check_finite:
            # It skips a non-finite step itself and lowers its scale (or the
            # user compiled with check_finite=False).
            return keras_apply(optimizer, reduced, variables)
        finite = nonfinite.all_finite(reduced)
        nonfinite.record(ctx, finite, weighted)
        _compat.apply_if(finite, lambda grads: keras_apply(optimizer, grads, variables), reduced)


def _cycle_logged(ctx, optimizer, count):
    """The loss tracker's total made one device's on the cycle's joined
    examples (`_compat.cycle_logged_loss`); returns the (variable, value)
    pair of what the cycle logged, to assign with the accumulators. Each
    tower adds its share of the correction to its own part of the total
    (the tracker's variables sum over the towers on reading)."""
    noted = getattr(ctx, "loss_log", None)
    if noted is None or noted[0] is not optimizer:
        return []
    _, (total, seen), (total_before, seen_before) = noted
    step = tf.stack([total.value - total_before, seen.value - seen_before, seen_before])
    correction, logged = _compat.cycle_logged_loss(optimizer, loss_divisors.global_sum(step), count)
    total.assign_add(correction / ctx.total)
    return [(_compat.loss_log_variable(optimizer), logged)]


# Whether sparse gradients reach the optimizer with each index once (the
# benchmark of their cost turns it off; nothing else should).
SUM_DUPLICATES = True


def _duplicates_summed(gradient):
    """A sparse gradient with each index once, its slices summed.

    The towers' slices of one variable, joined by the reduction, hold an
    index once per tower where one device's gradient holds it once (a
    position embedding looked up with `ops.arange`); Keras's Adam, RMSprop,
    Adagrad... square the slices before they sum duplicates, so the sum
    over towers would be squared in parts. Summed here, on every strategy
    (one tower too), the update is the one of the joined gradient. Dense
    gradients pass as they are.
    """
    if not SUM_DUPLICATES or not isinstance(gradient, tf.IndexedSlices):
        return gradient
    indices, positions = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(gradient.values, positions, tf.shape(indices)[0])
    return tf.IndexedSlices(values, indices, gradient.dense_shape)


# Entered by every TensorFlow tower (tower_scope.tower_scope), left when it ends.
TOWER_PATCHES = _compat.tower_patches(apply_in_tower)


def gradients_unless_empty(model, forward_backward, examples, variables):
    """Runs `forward_backward()` unless this tower's batch is empty.

    At the end of finite data some towers may get no batch. Such a tower must
    still join the all-reduce, but must not run the model: TF's oneDNN
    MaxPool gradient aborts the process on an empty batch. It contributes
    zero gradients instead (sparse ones stay sparse). A forward pass that
    all-reduces (synchronized BatchNormalization, a masked loss's divisor)
    cannot be skipped on some towers only: there the model runs on the
    empty batch, weighted zero.
    """
    cache = model.engine.cache
    if model.num_towers == 1 or cache.forward_collectives or any(
        getattr(layer, "synchronized", False) for layer in _compat.flatten_layers(model)
    ):
        return forward_backward()
    try:
        with loss_divisors.without_collectives():
            return _unless_empty(cache, forward_backward, examples, variables)
    except loss_divisors.ForwardCollectiveNeeded:
        # A masked loss all-reduces its divisor (loss_divisors.py): every
        # tower runs, an empty batch's loss weighted zero by its divisor.
        cache.forward_collectives = True
        return forward_backward()


def _unless_empty(cache, forward_backward, examples, variables):
    if tf.executing_eagerly():  # tf.cond would run one branch only
        if int(examples) > 0:
            cache.last_gradients = forward_backward()
            return cache.last_gradients
        last = cache.last_gradients or [None] * len(variables)
        return [None if g is None else _dense_or_sparse_zeros(g, v) for g, v in zip(last, variables)]
    traced = {}

    def compute():
        gradients = forward_backward()
        traced["gradients"] = gradients
        return [_dense_or_sparse_zeros(None, v) if g is None else g
                for g, v in zip(gradients, variables)]

    def skip():
        return [_dense_or_sparse_zeros(g, v) for g, v in zip(traced["gradients"], variables)]

    gradients = tf.cond(examples > 0, compute, skip)
    return [None if g is None else r for g, r in zip(traced["gradients"], gradients)]


def _dense_or_sparse_zeros(like, variable):
    if isinstance(like, tf.IndexedSlices):
        values = like.values
        return tf.IndexedSlices(
            tf.zeros([0] + list(variable.shape)[1:], values.dtype),
            tf.zeros([0], like.indices.dtype),
            tf.constant(list(variable.shape), like.dense_shape.dtype),
        )
    return tf.zeros(variable.shape, variable.dtype)
