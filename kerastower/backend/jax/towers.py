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
from kerastower import loss_divisors
from kerastower.backend.jax import sync as jax_sync
from kerastower.backend.jax.placement import AXIS

__all__ = ["on_every_tower", "sum_over_towers", "varying", "per_tower", "from_tower_0", "seed_positions", "seeded_apart", "all_finite",
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
        with jax_sync.synchronized_over(None):
            return branch(0, *args)
    branches = [functools.partial(branch, i) for i in range(num_towers)]
    # Masked losses divide by the joined batch's count (loss_divisors.py).
    with jax_sync.synchronized_over(AXIS), loss_divisors.MASKED_LOSSES:
        return jax.lax.switch(jax.lax.axis_index(AXIS), branches, *args)


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


def _varying_axes(value):
    aval = jax.typeof(value)
    axis_type = getattr(aval, "manual_axis_type", None)   # JAX >= 0.9
    return axis_type.varying if axis_type is not None else getattr(aval, "vma", frozenset())


def varying(value, num_towers=2):
    """`value` typed as varying over the towers: each tower's own copy.

    Inside `shard_map`, the gradient of a value every tower shares comes
    out summed over the towers; of a varying one, it is the tower's own.
    The branches of a switch over the towers must also return values of
    one type."""
    if num_towers == 1 or AXIS in _varying_axes(value):
        return value
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(value, AXIS, to="varying")
    return jax.lax.pvary(value, AXIS)


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


def seeded_apart(values, positions, index):
    """Tower `index`'s random streams: tower 0's seed moved by the index (as
    on TensorFlow), so no two towers draw the same Dropout mask or noise."""
    if index == 0:
        return list(values)
    values = list(values)
    for i in positions:
        values[i] = values[i] + jnp.asarray([index * 1_000_003, 0], values[i].dtype)
    return values


def all_finite(values):
    """Whether every float value of `values` is finite (one boolean)."""
    flags = [jnp.all(jnp.isfinite(v)) for v in values if jnp.issubdtype(v.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.asarray(True)


def first_nonfinite_step(finite):
    """(the index of the first step whose gradients were not finite, the
    towers to blame), from `train_steps`' flags (waiting for the steps), or
    None when every step applied its update or nothing was checked."""
    if finite is None:
        return None
    finite = np.asarray(finite)
    finite = finite[None] if finite.ndim == 1 else finite   # one step's
    for step, flags in enumerate(finite):
        if not flags.all():
            return step, np.flatnonzero(~flags).tolist()
    return None
