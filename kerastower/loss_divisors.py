"""Token-normalised losses, divided by the joined batch's count on every tower.

A masked loss (Keras's losses on a model output that carries a mask, as
`Embedding(mask_zero=True)` gives it) is a sum over the unmasked tokens
divided by their count. One device on the joined batch divides the sum of
every tower's tokens by the count of every tower's tokens, `V = sum_k v_k`.
Each tower dividing by its own `v_k` gives the towers' example-weighted
mean of `S_k / v_k`, which is the joined batch's only when every tower holds
the same share of tokens as of examples: with unequal padding it is not
(the gradient-accumulation bug the wider field met in 2024).

kerastower divides tower k's sum by `V * n_k / n` instead (`n_k` its
examples, `n` all towers' examples), one small all-reduce of `(v_k, n_k)`
per masked loss before the backward pass. The towers' gradients, weighted
by `n_k / n` as always, then sum to `sum_k grad S_k / V`: the joined
batch's, and the loss tracker, weighted by `n_k`, logs `sum_k S_k / V`.
On one tower the divisor is Keras's own. `MASKED_LOSSES` puts this into
Keras's `apply_mask` while towers are traced (both backends).

A loss of your own normalised by your own count gets the same from
`kt.loss_divisor(count)`:

Examples:
    >>> mask = keras.ops.convert_to_tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    >>> token_losses = keras.ops.ones((2, 3))
    >>> # Outside a tower (or on one), the divisor is the count itself.
    >>> total = keras.ops.sum(token_losses * mask)
    >>> float(total / kt.loss_divisor(keras.ops.sum(mask)))
    1.0
"""

import contextlib
import numbers
import warnings

import keras
import numpy as np

from kerastower import _compat
from kerastower.errors import ArgumentError
from kerastower.tower import get_current_tower_context

__all__ = ["loss_divisor", "global_sum", "MASKED_LOSSES", "ForwardCollectiveNeeded",
           "without_collectives", "step_loss_count"]


class ForwardCollectiveNeeded(Exception):
    """Raised while a tower's forward pass is traced where it cannot
    all-reduce: in a branch that some towers skip (an empty batch), where
    an all-reduce would wait for towers that never reach it, or inside an
    XLA-compiled function. The engine catches it and traces the forward
    pass again on every tower, uncompiled (`forward_collectives`)."""


@contextlib.contextmanager
def without_collectives():
    """While a tower's forward pass is traced where it cannot all-reduce (a
    branch an empty tower skips, an XLA-compiled function): a divisor asked
    for there raises ForwardCollectiveNeeded."""
    ctx = get_current_tower_context()
    saved = getattr(ctx, "forward_without_collectives", False)
    if ctx is not None:
        ctx.forward_without_collectives = True
    try:
        yield
    finally:
        if ctx is not None:
            ctx.forward_without_collectives = saved


def _summing_context():
    """The current tower context, where the towers' values can be summed
    (several towers, or processes); else None."""
    ctx = get_current_tower_context()
    if ctx is None or getattr(ctx, "sum_over_towers", None) is None:
        return None
    if getattr(ctx, "forward_without_collectives", False):
        raise ForwardCollectiveNeeded()
    return ctx


def _dtype_and_shape(value):
    """(the dtype's name, the static shape as a tuple with None where
    unknown, or None for an unknown rank) of a tensor, array, list or
    Python number; (None, None) for anything else."""
    if isinstance(value, (bool, np.bool_)):
        return "bool", ()
    if isinstance(value, numbers.Number) and not hasattr(value, "dtype"):
        kind = "int" if isinstance(value, numbers.Integral) else (
            "float" if isinstance(value, numbers.Real) else "complex")
        return kind, ()
    if value is None or isinstance(value, (str, bytes)):
        return None, None
    if not hasattr(value, "dtype"):
        try:
            value = keras.ops.convert_to_tensor(value)  # a list of numbers or tensors
        except Exception:  # noqa: BLE001 - not a number: described by its repr
            return None, None
    try:
        dtype = keras.backend.standardize_dtype(value.dtype)
    except (ValueError, TypeError):  # a dtype Keras does not know (str, object)
        dtype = str(value.dtype)
    shape = getattr(value, "shape", None)
    try:
        shape = None if shape is None else tuple(shape)
    except (TypeError, ValueError):  # a TensorShape of unknown rank
        shape = None
    return dtype, shape


def _description(value, dtype, shape):
    """`value` in words, for an error: its dtype and shape, or its repr."""
    if dtype is None or (shape == () and not hasattr(value, "shape")):
        text = repr(value)
        text = text if len(text) <= 60 else text[:57] + "..."
        return f"{text} ({type(value).__name__})"
    kind = ("array" if isinstance(value, np.ndarray) else
            type(value).__name__ if isinstance(value, (list, tuple)) else "tensor")
    if shape is None:
        shape_text = "of unknown shape"
    else:
        dims = ", ".join("None" if d is None else str(d) for d in shape)
        shape_text = f"of shape ({dims}{',' if len(shape) == 1 else ''})"
    article = "an" if dtype[0] in "aeiou" else "a"
    return f"{article} {dtype} {kind} {shape_text}"


def _is_real(dtype, bool_ok):
    if dtype in (None, "complex"):
        return False
    if dtype in ("bool", "int", "float"):
        return dtype != "bool" or bool_ok
    try:
        return keras.backend.is_float_dtype(dtype) or keras.backend.is_int_dtype(dtype)
    except (ValueError, TypeError):  # a dtype Keras does not know (str, object)
        return False


def _checked_scalar(value, call, argument, expected):
    """`value` unchanged where it is one real number (a Python or numpy
    number, or a tensor of shape ()); else an ArgumentError naming it.
    Checked on every tower count alike, so what would fail on N towers
    fails on one."""
    dtype, shape = _dtype_and_shape(value)
    if _is_real(dtype, bool_ok=False) and (shape == () or shape is None):
        return value
    problem = "must be one number" if _is_real(dtype, bool_ok=False) else "must be a real number"
    raise ArgumentError(
        f"{call}: {argument} {problem}, a scalar (a Python number or a tensor of shape ()) "
        f"of an int or float dtype; got {_description(value, dtype, shape)}. {expected}"
    )


def global_sum(value):
    """`value` summed over every tower and process of the step (in a tower);
    `value` itself elsewhere or on one tower.

    `value`: a tensor, array or Python number of an int, float or bool
    dtype, of the same shape on every tower (a scalar, per-class counts):
    it is summed element by element, as float32. Anything else (a str,
    None, a complex number) raises `kt.errors.ArgumentError`, on one tower
    too.

    Examples:
        >>> float(kt.global_sum(3.0))
        3.0
    """
    dtype, shape = _dtype_and_shape(value)
    if not _is_real(dtype, bool_ok=True):
        raise ArgumentError(
            f"kt.global_sum: value must be a tensor, array or Python number of an int, "
            f"float or bool dtype, of the same shape on every tower; got "
            f"{_description(value, dtype, shape)}."
        )
    ctx = _summing_context()
    value = keras.ops.cast(value, "float32")
    if ctx is None:
        return value
    return keras.ops.stop_gradient(ctx.sum_over_towers(value))


def loss_divisor(count, examples=None):
    """What this tower divides a sum over what it counts by, for the joined
    batch's `sum / count` over all towers: `V * n_k / n`, with `V` the
    `count` summed over every tower and process, `n_k` this tower's
    `examples` (default: its batch size) and `n` all towers' examples. One
    all-reduce; on one tower (or outside a tower) `count` itself.

    Write a token-normalised loss as `ops.sum(token_losses * mask) /
    kt.loss_divisor(ops.sum(mask))`: on N towers it trains, and logs, as one
    device on the joined batch, however unequal the towers' counts.

    `count` and `examples` are each one number, a scalar of an int or
    float dtype (`ops.sum(mask)`, not the mask or a count per example);
    anything else raises `kt.errors.ArgumentError` naming what was given,
    on one tower as on N.

    Examples:
        >>> float(kt.loss_divisor(7.0))   # outside a tower: the count itself
        7.0
    """
    _checked_scalar(count, "kt.loss_divisor", "count", _COUNT_EXPECTED)
    if examples is not None:
        _checked_scalar(examples, "kt.loss_divisor", "examples",
                        "Pass this tower's number of examples, or leave it to default to "
                        "the tower's batch size.")
    ctx = _summing_context()
    count = keras.ops.cast(count, "float32")
    if ctx is None:
        _record_count(count)
        return count
    if examples is None:
        examples = ctx.batch_size
    examples = keras.ops.cast(examples, "float32")
    summed = keras.ops.stop_gradient(ctx.sum_over_towers(keras.ops.stack([count, examples])))
    _record_count(summed[0])
    return summed[0] * keras.ops.divide_no_nan(examples, summed[1])


def _record_count(joined):
    """Notes on the tower's context the joined count a loss of this step
    divided by: gradient accumulation weighs its micro-steps by it
    (`step_loss_count`)."""
    ctx = get_current_tower_context()
    if ctx is not None:
        ctx.loss_counts = getattr(ctx, "loss_counts", ()) + (joined,)


def step_loss_count(ctx, warn=False):
    """The joined count the step's token-normalised loss divided by (the
    same on every tower), or None where no loss of the step had one. A
    step with several losses of their own counts has no one count to weigh
    its gradient by: None, and (with `warn`) a warning, which Python shows
    once per run."""
    counts = getattr(ctx, "loss_counts", ())
    if len(counts) == 1:
        return counts[0]
    if counts and warn:
        warnings.warn(
            f"kerastower: this step divides {len(counts)} losses by counts of their own "
            "(masked losses or kt.loss_divisor), so gradient accumulation cannot weigh its "
            "micro-steps by one count: it averages them as Keras does, which is not the "
            "joined batch's gradient when the micro-steps' counts differ. Use one "
            "token-normalised loss, or no gradient_accumulation_steps, for exact results.",
            stacklevel=2)
    return None


_COUNT_EXPECTED = (
    "Pass the tower's total count, e.g. kt.loss_divisor(keras.ops.sum(mask)) for a mask "
    "of the tokens that count, and divide the summed loss by it.")


# Read when a step is traced; benchmarks/token_divisors.py turns it off to
# measure what the joined count costs (Keras's per-tower count then).
JOINED_MASKED_COUNTS = True


def _masked_loss_divisor(valid, batch_size):
    # Keras's masked losses: None leaves Keras's own count.
    if not JOINED_MASKED_COUNTS:
        return None
    if _summing_context() is None:
        _record_count(keras.ops.cast(valid, "float32"))
        return None
    return loss_divisor(valid, batch_size)


MASKED_LOSSES = _compat.masked_losses_divided_by(_masked_loss_divisor)
