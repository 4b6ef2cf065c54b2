"""What every tower step on JAX does to its values, whichever step it is.

fit's step (step.py) and kt.Trainer's tower functions
(tower_function.py) both run the towers as branches of one
`shard_map` over the towers' mesh axis, through one primitive
(`on_every_tower`); both need each tower's own copy of
the weights (so that their gradients are not summed), tower 0's values
as everyone's, random seeds moved per tower, and NaN/Inf flags.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kerastower import _compat
from kerastower._compat import on_jax as jax_compat
from kerastower import loss_divisors
from kerastower import loss_reductions
from kerastower.backend.jax import sync as jax_sync
from kerastower.backend.jax.placement import AXIS
from kerastower.backend.jax.varying import varying

__all__ = ["on_every_tower", "sum_over_towers", "per_tower", "from_tower_0", "seed_positions", "seeded_apart", "all_finite", "sums_finite", "abs_sum",
           "first_nonfinite_step", "mean_over_towers"]


def on_every_tower(branch, num_towers, *args):
    """`branch(index, *args)` as this device's tower: where JAX runs a step on every tower.

    Called inside the towers' `shard_map` (fit's, evaluate's and predict's
    steps, and a tower function's), it traces `branch` once per tower and
    runs this device's (`lax.switch` on the axis index). While the branches
    are traced, synchronized BatchNormalization's moments sum over the
    towers and recurrent layers' states are each tower's own (sync.py).
    One tower runs its branch alone, its moments its batch's.
    """
    if num_towers == 1:
        # A masked loss's count is Keras's own, noted for accumulation.
        with jax_sync.synchronized_over(None), loss_divisors.MASKED_LOSSES:
            return branch(0, *args)
    # Masked losses divide by the joined batch's count (loss_divisors.py),
    # each of Keras's reductions is the joined batch's (loss_reductions.py).
    with jax_sync.synchronized_over(AXIS), loss_divisors.MASKED_LOSSES, \
            loss_reductions.JOINED_REDUCTIONS:
        traced = [jax.make_jaxpr(functools.partial(branch, i), return_shape=True)(*args)
                  for i in range(num_towers)]
    leaves = jax.tree.leaves(args)
    runs = [jax_compat.jaxpr_as_fun(jaxpr) for jaxpr, _ in traced]
    shapes = traced[0][1]
    if all(_same_computation(traced[0][0], jaxpr) for jaxpr, _ in traced[1:]):
        # No tower's step depends on its index (the common case): every
        # tower runs the one computation, without a switch. XLA:CPU runs a
        # convolution inside a conditional many times slower (a ConvNet's
        # step on 2 towers 1.8 s against 0.1 s).
        outputs = runs[0](*leaves)
    else:
        outputs = jax.lax.switch(jax.lax.axis_index(AXIS), runs, *leaves)
    # Typed as the switch's would be: each tower's own.
    outputs = [varying(value, num_towers) for value in outputs]
    return jax.tree.unflatten(jax.tree.structure(shapes), outputs)


def _same_computation(one, other):
    """Whether two closed jaxprs compute the same thing from the same inputs."""
    if str(one.jaxpr) != str(other.jaxpr) or len(one.consts) != len(other.consts):
        return False
    for a, b in zip(one.consts, other.consts):
        if a is b:
            continue
        if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
            return False
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype or not np.array_equal(a, b, equal_nan=True):
            return False
    return True


def sum_over_towers(num_towers):
    """What a tower context sums a value over the towers with, inside the
    towers' shard_map (`kt.global_sum`, `kt.loss_divisor`); None on one tower."""
    if num_towers == 1:
        return None
    return functools.partial(jax.lax.psum, axis_name=AXIS)


def mean_over_towers(gradients, weight=None):
    """The towers' gradients averaged: where gradients are reduced on JAX.

    Each tower's are weighted by its examples (`weight`, this tower's
    count), so the mean is that of one device on the joined batch; with
    `weight=None` every tower counts the same (fit's step, whose towers'
    batches have one shape). Called inside `shard_map`, by fit's step
    (step.py) and by `optimizer.apply` in a tower function
    (tower_function.py).
    """
    if weight is None:
        return [jax.lax.pmean(g, AXIS) for g in gradients]
    total = jax.lax.psum(weight, AXIS)
    return [jax.lax.psum(g * weight.astype(g.dtype), AXIS) / total.astype(g.dtype) for g in gradients]


def per_tower(values, num_towers):
    """Every one of `values` as varying over the towers."""
    return [varying(v, num_towers) for v in values]


def from_tower_0(values, num_towers):
    """Tower 0's `values`, the same on every tower.

    A masked psum, not all_gather: shard_map then knows the result is
    replicated. One tower too, whose values computed from its batch vary
    over the axis.
    """
    if num_towers == 1:
        return list(values)
    first = jax.lax.axis_index(AXIS) == 0

    def take(v):
        if v.dtype == jnp.bool_:
            return take(v.astype(jnp.int32)).astype(jnp.bool_)
        return jax.lax.psum(jnp.where(first, v, jnp.zeros_like(v)), AXIS)

    return [take(v) for v in values]


def seed_positions(model, variables):
    """Where the states of `model`'s seed generators sit in `variables`."""
    states = {id(generator.state)
              for layer in _compat.flatten_layers(model)
              for generator in _compat.seed_generators(layer)}
    return [i for i, v in enumerate(variables) if id(v) in states]


def seeded_apart(values, positions, num_towers):
    """This tower's random streams: tower 0's seed moved by the tower's
    index (as on TensorFlow), so no two towers draw the same Dropout mask or
    noise. The index is read on the device (`axis_index`), so the towers'
    steps stay one computation (`on_every_tower`)."""
    values = list(values)
    if num_towers == 1 or not positions:
        return values
    index = jax.lax.axis_index(AXIS)
    for i in positions:
        offset = jnp.stack([index.astype(values[i].dtype) * 1_000_003, jnp.zeros((), values[i].dtype)])
        values[i] = values[i] + offset
    return values


def all_finite(values):
    """Whether every float value of `values` is finite (one boolean).

    A sum is NaN or Inf when a term is, and XLA reduces a sum faster than
    it reduces `isfinite` (a 1024-wide MLP's gradients on a 2-core VM:
    0.14 against 0.49 ms): the common, finite, case costs the sums only
    (`sums_finite`). A sum can also overflow to Inf from huge finite terms,
    so a sum that is not finite is confirmed value by value.
    """
    values = _float_values(values)
    if not values:
        return jnp.asarray(True)

    def value_by_value():
        return jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in values]))

    sums_finite_ = sums_finite(values)
    # The first branch gives the flag itself (True there): inside the towers'
    # shard_map it is typed as varying over the towers, as the second's is.
    return jax.lax.cond(sums_finite_, lambda: sums_finite_, value_by_value)


def sums_finite(values):
    """Whether the sum of each float value of `values` is finite: True only
    where every value is finite (a NaN or an Inf makes its sum one); False
    may still be a finite value whose sum overflowed (`all_finite` then
    looks value by value). No conditional: where a step's update is gated
    anyway, the gate's own cond takes the rare second look
    (finite_check.py)."""
    values = _float_values(values)
    if not values:
        return jnp.asarray(True)
    return jnp.all(jnp.stack([jnp.isfinite(_sum(v)) for v in values]))


def _float_values(values):
    # None: a variable a custom train_step gave no gradient.
    return [v for v in values if v is not None and jnp.issubdtype(v.dtype, jnp.inexact) and v.size]


def abs_sum(value):
    """The sum of `value`'s absolute values, as the finite check takes sums
    (`_sum`): at least its largest one, NaN or Inf where one is."""
    return _sum(jnp.abs(value))


def _sum(value):
    """The sum of `value`'s elements, as the finite check takes it.

    On XLA:CPU, a reduction to one number runs on one thread, and inside a
    train step it cost 10-17% of a 1024-wide MLP's step (2-core VM); a
    product with a vector of ones runs as a matrix-vector product (Eigen:
    vectorised, threaded) and cost 5-6%. Elsewhere XLA's reductions are
    its fast path, so they are kept (chosen as the step is compiled for
    its devices). Either way a NaN or an Inf among the terms makes the sum
    NaN or Inf.
    """
    dtype = _sum_dtype(value.dtype)

    def by_products():
        rows = value.reshape(-1, value.shape[-1]) if value.ndim else value.reshape(1, 1)
        ones = jnp.ones((rows.shape[1],), value.dtype)
        return jnp.sum(jnp.matmul(rows, ones, preferred_element_type=dtype))

    def reduced():
        return jnp.sum(value, dtype=dtype)

    # Chosen for the devices the step is compiled for, not the process's
    # default backend.
    return jax.lax.platform_dependent(cpu=by_products, default=reduced)


def _sum_dtype(dtype):
    # Half-precision sums overflow early: summed in float32 (exact either way,
    # only a false alarm costs the value-by-value pass).
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
        return jnp.float32
    return None


def first_nonfinite_step(finite):
    """(the index of the first step whose gradients were not finite, the
    towers to blame), from `train_steps`' flags (waiting for the steps), or
    None when every step applied its update or nothing was checked."""
    if finite is None:
        return None
    finite = np.asarray(finite)
    if np.logical_and.reduce(finite, axis=None):
        return None
    finite = finite[None] if finite.ndim == 1 else finite   # one step's
    for step, flags in enumerate(finite):
        if not flags.all():
            return step, np.flatnonzero(~flags).tolist()
    return None
