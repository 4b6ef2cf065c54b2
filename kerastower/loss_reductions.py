"""Each reduction of Keras's losses, reduced over the towers as one device on the joined batch.

kerastower weights each tower's gradients, and its logged loss, by its
share of the step's examples, `n_k / n`: the towers' weighted mean, which
is the joined batch's loss when a tower's loss is a mean over its examples.
Keras's reductions (`Loss(reduction=...)`) are not all means:

- `"sum_over_batch_size"` (the default, and `"mean"`): the sum over the
  tower's entries divided by their number, a mean: exact as it is (a
  masked loss divides by the joined batch's count: loss_divisors.py).
- `"sum"`: the sum over the tower's entries, `S_k`. The joined batch's is
  `sum_k S_k`, which the weighted mean is not. In the compiled loss, each
  tower's `S_k` is divided by its share `n_k / n`: weighted, the towers
  then add up to `sum_k S_k`. Only that component is divided, so the
  regularisation losses added to it (`model.losses`) still count once.
- `"mean_with_sample_weight"`: the weighted sum `W_k` divided by the sum
  of the tower's sample weights `w_k`. The joined batch's is
  `sum_k W_k / sum_k w_k`; each tower divides by `kt.loss_divisor(w_k)`,
  `(sum_j w_j) * n_k / n`, instead (one all-reduce of two numbers).
- `None` / `"none"`: the values unreduced, for code of one's own to reduce.
  kerastower cannot see how (a mean? a sum?) and assumes a mean over the
  tower's examples; it says so once per model, on N towers, unless the
  code normalised its loss over the joined batch itself (it summed
  something over the towers: `kt.loss_divisor`, `kt.global_sum`). So does
  a `"sum"` computed outside the compiled loss (a `compute_loss` or
  `train_step` of one's own), where what the sum becomes is the code's.

`JOINED_REDUCTIONS` puts this into Keras's `reduce_values` while towers
are traced, on both backends (`_compat.loss_reductions_replaced`); on one
tower Keras's own reductions run. It also weighs the per-output logged
losses (`a_loss`) of a tower by its examples where Keras, knowing no
static batch size (TensorFlow), would count each batch once: they are then
example-weighted over the towers, as the total loss is, on one tower or N
and on both backends.
"""

import threading
import warnings
import weakref

import keras

from kerastower import _compat
from kerastower import loss_divisors
from kerastower.tower import get_current_tower_context

__all__ = ["JOINED_REDUCTIONS", "warn_if_unseen"]


def _trivial(values):
    # Keras returns such values as they are, whatever the reduction.
    return tuple(values.shape) in ((), (0,))


def _joined_sums(ctx, function):
    """`function()`, which sums over the towers for kerastower's own use:
    not the tower's code normalising its loss (`summed_over_towers`)."""
    saved = ctx.summed_over_towers
    try:
        return function()
    finally:
        ctx.summed_over_towers = saved


def _share(ctx):
    """This tower's share of the step's examples, `n_k / n`: the weight of
    its gradients in training, of its logged loss in evaluation."""
    if ctx.is_training and ctx.example_weight is not None:
        return keras.ops.cast(ctx.example_weight, "float32")
    examples = ctx.num_examples if ctx.batch_size is None else ctx.batch_size
    if examples is None:
        return None
    examples = keras.ops.cast(examples, "float32")
    return keras.ops.divide_no_nan(examples, loss_divisors.global_sum(examples))


def _reduce_in_tower(keras_reduce, values, sample_weight, reduction, compiled):
    ctx = get_current_tower_context()
    if ctx is None or ctx.total == 1 or ctx.sum_over_towers is None:
        return keras_reduce(values, sample_weight, reduction)
    if reduction in (None, "none", "sum") and not compiled:
        # Reduced (or left unreduced) by code kerastower cannot see the end of.
        if ctx.is_training:
            ctx.unseen_reductions.append(reduction)
        return keras_reduce(values, sample_weight, reduction)
    if reduction in (None, "none"):
        return keras_reduce(values, sample_weight, reduction)
    if _trivial(values):
        return keras_reduce(values, sample_weight, reduction)
    if reduction == "sum":
        loss = keras_reduce(values, sample_weight, reduction)
        share = _joined_sums(ctx, lambda: _share(ctx))
        if share is None:
            return loss
        return keras.ops.divide_no_nan(loss, keras.ops.cast(share, loss.dtype))
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        # Keras's own reduction, divided by the joined batch's weights.
        loss = keras.ops.sum(values)
        weights = keras.ops.sum(keras.ops.cast(sample_weight, "float32"))
        divisor = _joined_sums(ctx, lambda: loss_divisors.loss_divisor(weights))
        # Inside a tower a mean is not divided by the number of replicas
        # (Keras's scale_loss_for_distribution): nothing to scale here.
        return keras.ops.divide_no_nan(loss, keras.ops.cast(divisor, loss.dtype))
    return keras_reduce(values, sample_weight, reduction)


def _output_loss_weight():
    """The weight of a tower's per-output logged loss (`a_loss`) where Keras
    knows no static batch size (TensorFlow): the tower's examples, so the
    figure is example-weighted over the towers as the total loss is (and
    as Keras weighs it where the size is static, JAX); None (Keras's: the
    batch once) outside a tower."""
    ctx = get_current_tower_context()
    if ctx is None:
        return None
    examples = ctx.num_examples if ctx.batch_size is None else ctx.batch_size
    return None if examples is None else keras.ops.cast(examples, "float32")


JOINED_REDUCTIONS = _compat.loss_reductions_replaced(_reduce_in_tower, _output_loss_weight)

_warned = weakref.WeakSet()
_warned_lock = threading.Lock()


def warn_if_unseen(model, ctx):
    """At the end of a training tower's step: warns, once per model, that
    a loss was reduced where kerastower cannot see how (see the module)."""
    unseen = list(dict.fromkeys(ctx.unseen_reductions))
    ctx.unseen_reductions = []
    if not unseen or ctx.summed_over_towers or ctx.total == 1:
        return
    with _warned_lock:
        if model in _warned:
            return
        _warned.add(model)
    name = type(model).__name__
    found = " and ".join(f"reduction={r!r}" for r in unseen)
    warnings.warn(
        f"kerastower: {name}'s step computes a Keras loss with {found} outside the compiled "
        "loss, so kerastower cannot see how the tower's loss reduces over its batch. It "
        "assumes a mean over the tower's examples, and weights each tower's gradients and "
        "logged loss by its share of the step's examples, n_k / n: a loss summed over the "
        "tower's batch then trains, and logs, as the towers' mean, not as one device on the "
        "joined batch. To train as one device: pass the loss to compile(loss=...) (each of "
        "Keras's reductions is exact there), or normalise it over the joined batch, "
        "`ops.sum(values) / kt.loss_divisor(count)` (a sum over the joined batch: divide the "
        "tower's sum by kt.get_current_tower_context().example_weight). A mean over the "
        "tower's examples is right as it is. See docs/training.md, 'Loss reductions over "
        "towers'.",
        stacklevel=2,
    )
