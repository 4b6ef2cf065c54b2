"""A value typed as each tower's own inside the towers' `shard_map` (`varying`).

Inside `shard_map`, JAX types every value as varying over the towers' mesh
axis (each tower's own) or not (the same on every tower); the type decides
how its gradient is reduced and whether a switch's branches agree.
"""

import jax

from kerastower.backend.jax.placement import AXIS

__all__ = ["varying"]


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
