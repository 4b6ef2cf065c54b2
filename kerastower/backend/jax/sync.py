"""Synchronized BatchNormalization on JAX towers: moments over every tower's examples.

While a tower's step is traced inside the engine's `shard_map`
(`synchronized_over(AXIS)`, set by step.py), `keras.ops.moments(...,
synchronized=True)` - what `BatchNormalization(synchronized=True)` calls in
training - sums over the tower axis: every tower normalizes by the mean and
variance of all towers' examples, each example counted once, as one device
would on the joined batch. The gradient flows through the sums, so it is
that one device's too; the moving statistics come out the same on every
tower. Outside the towers (one device, eager calls) the moments are the
layer's own batch's, as on TensorFlow without a strategy.

Keras itself refuses the layer on JAX. kerastower's patches admitting it
(_compat/on_jax.py) are in place only while kerastower needs them:
`SYNCHRONIZED_BATCHNORM` (the constructor and the moments) while a
`kt.distributed` block is open, where models are built; the moments alone
while the engine traces a step (`synchronized_over`). Outside every
kerastower scope Keras is its own: the layer cannot be built there, and one
built inside raises Keras's own error if it is trained there.
"""

import contextlib
import math
import threading

import jax
import jax.numpy as jnp
import keras

from kerastower._compat import PatchGroup
from kerastower._compat import on_jax as jax_compat
from kerastower.backend.jax.varying import varying
from kerastower.errors import KerasTowerError

__all__ = ["synchronized_over", "moments", "SYNCHRONIZED_BATCHNORM"]

_local = threading.local()


@contextlib.contextmanager
def synchronized_over(axis_name):
    """Within it, synchronized moments reduce over the mesh axis `axis_name`.

    None: they do not reduce over any axis (the layer's own batch). Keras's
    moments are routed here while it is open: the engine opens it around
    every tower step it traces, one tower included. Over an axis, recurrent
    layers' initial states are typed as each tower's own (see
    `_compat/on_jax.py`), as their carries become after one step.
    """
    saved = getattr(_local, "axis", None)
    with _MOMENTS_ROUTED, (_RNN_STATES_TYPED if axis_name is not None else contextlib.nullcontext()):
        _local.axis = axis_name
        try:
            yield
        finally:
            _local.axis = saved


def _each_towers_own(value):
    """`value` typed as varying over the towers' axis, while one is traced."""
    return value if getattr(_local, "axis", None) is None else varying(value)


def moments(x, axes, keepdims, local_moments):
    """Mean and variance of `x` over `axes` and over the towers.

    Sums and example counts are added over the tower axis, then divided;
    outside the towers, `local_moments(x, axes, keepdims)` (Keras's own).
    """
    axis_name = getattr(_local, "axis", None)
    if axis_name is None:
        if keras.distribution.distribution() is not None:
            # Keras's own data parallelism would get each device's moments
            # alone, where the layer asks for all devices'.
            raise KerasTowerError(
                "BatchNormalization(synchronized=True) on JAX is synchronized over "
                "kerastower's towers only (a kt.TowerModel under kt.distributed); under "
                f"keras.distribution ({type(keras.distribution.distribution()).__name__}) its "
                "moments would be each device's alone. Train it as a kt.TowerModel, or use "
                "synchronized=False.")
        return local_moments(x, axes, keepdims)
    x = jnp.asarray(x)
    dtype = x.dtype
    if dtype in (jnp.float16, jnp.bfloat16):
        x = x.astype(jnp.float32)  # as Keras does: float16 is too narrow for statistics
    axes = tuple(a % x.ndim for a in ((axes,) if isinstance(axes, int) else axes))
    count = jnp.asarray(math.prod(x.shape[a] for a in axes), x.dtype)
    total = jax.lax.psum(count, axis_name)
    mean = jax.lax.psum(jnp.sum(x, axes, keepdims=True), axis_name) / total
    variance = jax.lax.psum(jnp.sum(jnp.square(x - mean), axes, keepdims=True), axis_name) / total
    if not keepdims:
        mean, variance = jnp.squeeze(mean, axes), jnp.squeeze(variance, axes)
    if x.dtype != dtype:
        limit = jnp.finfo(jnp.float16).max
        mean = jnp.clip(mean, -limit, limit).astype(dtype)
        variance = jnp.clip(variance, -limit, limit).astype(dtype)
    return mean, variance


# One ScopedPatch per Keras function, shared by every scope that enters it:
# it counts how many hold it and puts Keras's own back when the last ends.
_MOMENTS_ROUTED = jax_compat.synchronized_moments_routed(moments)
_RNN_STATES_TYPED = jax_compat.rnn_initial_states_typed(_each_towers_own)
# What a kt.distributed block enters on JAX: while it is open,
# BatchNormalization(synchronized=True) builds and its moments are these.
SYNCHRONIZED_BATCHNORM = PatchGroup([jax_compat.synchronized_batchnorm_admitted(), _MOMENTS_ROUTED])
