"""Inside a TensorFlow tower: its TowerContext and what a tower keeps apart.

`tower_scope` is entered once per tower per step (step.py's `tower_fn`, and
a custom `train_step`'s `model.tower_scope`): it sets the tower's context
(its index, its share of the step's examples, how it reduces), applies the
tower rules, puts back what a step with non-finite gradients changed, and
makes the towers' replica-local weights (BatchNormalization's statistics)
follow the main tower's. `seed_towers_apart` gives each tower its own
random stream.
"""

import contextlib

import tensorflow as tf

from kerastower import _compat
from kerastower import loss_divisors
from kerastower import loss_reductions
from kerastower.backend.tensorflow import gradients
from kerastower.tower import TowerContext
from kerastower.tower import forbid_variable_creation

__all__ = ["tower_scope", "seed_towers_apart"]


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
        # Through kt.global_sum: read in a forward pass some towers skip
        # (an empty batch), the step is traced again with every tower
        # running it (loss_divisors.ForwardCollectiveNeeded).
        ctx.defer_example_weight(lambda: tf.math.divide_no_nan(n, loss_divisors.global_sum(n)))
    with gradients.TOWER_PATCHES, loss_divisors.MASKED_LOSSES, loss_reductions.JOINED_REDUCTIONS, \
            ctx, tf.summary.record_if(ctx.is_main_tower), forbid_variable_creation(step_name):
        kept = _kept_for_a_nonfinite_step(model, ctx) if is_training else None
        if is_training:
            _note_loss_tracker(model, ctx)
        yield ctx
        if is_training:
            loss_reductions.warn_if_unseen(model, ctx)
        if kept is not None:
            _put_back_unless_finite(ctx, kept)
        if is_training:
            _follow_main_tower(model, ctx)


def _note_loss_tracker(model, ctx):
    """With gradient accumulation of a token-normalised loss: the loss
    tracker's variables and this tower's values of them before the step,
    from which `optimizer.apply` corrects what the micro-step logged
    (`_compat.cycle_logged_loss`)."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or _compat.loss_log_variable(optimizer) is None:
        return
    sums = _compat.tracker_sums(_compat.loss_tracker(model))
    ctx.loss_log = (optimizer, sums, [tf.identity(v.value) for v in sums])


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
