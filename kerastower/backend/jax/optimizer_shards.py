"""Sharded optimizer state on JAX: each of N towers keeps 1/N of every optimizer slot.

Under `kt.distributed("mirrored", shard_optimizer=True)` the towers still
each hold the whole weights (each computes its gradients on its own
batch), but every slot the optimizer keeps per weight (Adam's momentum
and velocity, SGD's momentum, an EMA's average...) is cut into N equal
pieces, one per tower:

- a slot is flattened and padded with zeros to `N * chunk` values
  (`chunk = ceil(size / N)`); tower i keeps values `[i * chunk, (i+1) * chunk)`;
- a step reduce-scatters the towers' gradients (each tower receives the
  mean of its piece only: `psum_scatter`), clips them with norms summed
  over the towers, and updates its piece of each weight with its piece of
  each slot: a copy of the user's optimizer built on piece-shaped
  variables (`stateless_apply`, Keras's own update rule);
- the updated pieces are all-gathered into the whole weights, the same on
  every tower.

The optimizer's update must act value by value for the pieces to give the
replicated run's numbers: `ELEMENTWISE` names the Keras optimizers that
do. Scalars (the step counter, a learning rate held in a variable) stay
whole on every tower.

What the towers hold between steps is the pieces (`placed`); the
model's optimizer variables get the whole values when something reads
them (`whole_values`, at a sync), so a checkpoint holds the whole state
and resumes onto any number of towers, sharded or not. On an accelerator
those whole values are kept in host memory.

Example:
    >>> import numpy as np
    >>> from kerastower.backend.jax.optimizer_shards import OptimizerShards
    >>> weight = keras.Variable(np.ones((3, 2), "float32"))
    >>> optimizer = keras.optimizers.Adam()
    >>> optimizer.build([weight])
    >>> shards = OptimizerShards(optimizer, num_towers=4)
    >>> shards.chunks, [tuple(v.shape) for v in shards.copy.variables]
    ([2], [(), (), (2,), (2,)])
"""

import math

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.sharding import NamedSharding

from kerastower import _compat
from kerastower._compat import on_jax as jax_compat
from kerastower.backend.jax.placement import AXIS
from kerastower.backend.jax.towers import all_finite
from kerastower.backend.jax.placement import BY_TOWER
from kerastower.backend.jax.placement import REPLICATED
from kerastower.errors import KerasTowerError

__all__ = ["OptimizerShards", "ELEMENTWISE", "check_shardable"]

# The Keras optimizers whose update of a value reads only that value's
# gradient and slots (and scalars): cut into pieces, they compute what the
# whole would. Adafactor (factored slots), Lamb (a trust ratio over each
# whole weight) and Muon (orthogonalised matrices) read whole weights.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Ftrl", "Lion")


def check_shardable(optimizer):
    """Raises a KerasTowerError saying why, where `optimizer`'s state cannot
    be sharded exactly."""
    name = type(optimizer).__name__
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise KerasTowerError(
            f"shard_optimizer=True: {optimizer.name} is a LossScaleOptimizer (mixed precision, "
            "or compile(auto_scale_loss=True)); its loss scale is not sharded yet. Train in "
            "float32 or bfloat16 (no loss scaling) with shard_optimizer=True, or leave it off.")
    if type(optimizer) not in {getattr(keras.optimizers, n) for n in ELEMENTWISE}:
        raise KerasTowerError(
            f"shard_optimizer=True: the optimizer is a {name}, whose update kerastower does not "
            f"know to act value by value; sharded, it could compute another update than the "
            f"replicated one. Sharded optimizers: {', '.join('keras.optimizers.' + n for n in ELEMENTWISE)}.")
    if _compat.accumulation_steps(optimizer):
        raise KerasTowerError(
            f"shard_optimizer=True: {optimizer.name} accumulates gradients "
            f"(gradient_accumulation_steps={optimizer.gradient_accumulation_steps}); sharded "
            "accumulation is not built yet (Keras's JAX accumulation chooses between new zeros and "
            "the accumulated pieces, which inside the towers' shard_map are typed differently). "
            "Leave one of the two off.")


class OptimizerShards:
    """How `optimizer`'s state is cut into one piece per tower, and the
    update each tower makes on its pieces.

    Args:
        optimizer: the model's built optimizer (one of `ELEMENTWISE`).
        num_towers: N, the towers the state is cut over.

    Attributes:
        copy: the optimizer rebuilt from its config on piece-shaped
            variables (without clipnorm and global_clipnorm: `clipped`
            takes the norms over every tower's pieces).
        chunks: each trainable weight's piece size, in the order the
            optimizer was built on.
        slot_of: for each of `optimizer.variables`, the index of the weight
            it is a slot of (cut into pieces), or None (kept whole).
    """

    def __init__(self, optimizer, num_towers):
        check_shardable(optimizer)
        weights = _compat.optimizer_variables(optimizer)
        self.num_towers = num_towers
        self.shapes = [tuple(w.shape) for w in weights]
        self.dtypes = [w.dtype for w in weights]
        self.sizes = [math.prod(shape) for shape in self.shapes]
        self.chunks = [-(-size // num_towers) for size in self.sizes]
        self.clipnorm = optimizer.clipnorm
        self.global_clipnorm = optimizer.global_clipnorm
        self.copy, self.slot_of = _piece_copy(optimizer, weights, self.chunks)
        self.specs = [REPLICATED if slot is None else BY_TOWER for slot in self.slot_of]
        self._slot_dtypes = [v.dtype for v in optimizer.variables]

    # -- between steps: the host side -------------------------------------

    def placed(self, values, mesh):
        """The optimizer's whole `values` as the towers hold them: each slot
        flattened, padded and cut over `mesh`'s towers; the rest whole on
        every tower."""
        pieces = NamedSharding(mesh, BY_TOWER)
        whole = NamedSharding(mesh, REPLICATED)
        arrays, shardings = [], []
        for value, slot in zip(values, self.slot_of):
            if slot is None:
                arrays.append(value)
                shardings.append(whole)
            else:
                flat = np.asarray(value).reshape(-1)
                arrays.append(np.pad(flat, (0, self.chunks[slot] * self.num_towers - flat.size)))
                shardings.append(pieces)
        # One device_put for all: JAX's cost per call adds up over many variables.
        return list(jax.device_put(arrays, shardings)) if arrays else []

    def whole_values(self, held, mesh):
        """The optimizer's whole values from what the towers hold (`placed`),
        for its variables: on the host where the towers are accelerators."""
        host = _host(mesh)
        # One transfer for all the slots' pieces.
        fetched = iter(jax.device_get([value for value, slot in zip(held, self.slot_of) if slot is not None]))
        values = []
        for value, slot in zip(held, self.slot_of):
            if slot is not None:
                value = np.asarray(next(fetched))[:self.sizes[slot]].reshape(self.shapes[slot])
            values.append(value if host is None else jax.device_put(value, host))
        return values

    def keep_on_host(self, variables, mesh):
        """Moves the whole slots `variables` (the optimizer's) hold to the
        host where the towers are accelerators: built whole on the default
        device, they would stay there beside the pieces."""
        host = _host(mesh)
        if host is None:
            return
        for variable, slot in zip(variables, self.slot_of):
            if slot is not None and variable.value.devices() != {host}:
                variable.assign(jax.device_put(variable.value, host))

    # -- inside the towers' shard_map ------------------------------------

    def update(self, gradients, weights, optimizer_pieces, going, check_finite=True):
        """(new whole weights, new optimizer pieces, finite): one step's
        update from each tower's `gradients`. Each tower receives its piece
        of the mean gradient (a reduce-scatter), updates its piece of every
        weight, and the pieces are gathered into the whole weights. A step
        is applied on every tower or on none (`going` False, or, checked,
        a NaN or Inf in any tower's piece): the towers agree on it."""
        gradient_pieces = self.gradient_pieces(gradients)
        weight_pieces = self.own_pieces(weights)
        finite = going
        if check_finite:
            unfinite = jax.lax.psum(jnp.logical_not(all_finite(gradient_pieces)).astype(jnp.int32), AXIS)
            finite = jnp.logical_and(unfinite == 0, going)

        def apply():
            return self.applied(optimizer_pieces, gradient_pieces, weight_pieces)

        def keep():
            return list(weight_pieces), list(optimizer_pieces)

        # A cond outside the gather: every tower takes the same branch, and
        # the collectives run on all of them.
        new_pieces, new_optimizer = jax.lax.cond(finite, apply, keep)
        return self.whole(new_pieces), new_optimizer, finite

    def tower_view(self, optimizer_pieces):
        """What a tower's `train_step` gets as the optimizer's values: the
        whole scalars, and for each slot a whole-shaped stand-in of NaNs
        (the step hands its gradients out instead of applying them, so it
        reads no slot; code that does gets NaN, never a silent piece)."""
        return [piece if slot is None else jnp.full(self.shapes[slot], jnp.nan, dtype)
                for piece, slot, dtype in zip(optimizer_pieces, self.slot_of, self._slot_dtypes)]

    def gradient_pieces(self, gradients):
        """This tower's piece of the towers' mean gradient of each weight
        (a reduce-scatter: each tower receives only its piece)."""
        pieces = []
        for i, gradient in enumerate(gradients):
            if gradient is None:
                gradient = jnp.zeros(self.shapes[i], self.dtypes[i])  # a weight given no gradient
            summed = jax.lax.psum_scatter(self._padded(gradient, i), AXIS, scatter_dimension=0, tiled=True)
            pieces.append(summed / jnp.asarray(self.num_towers, summed.dtype))
        return pieces

    def own_pieces(self, values):
        """This tower's piece of each whole weight."""
        index = jax.lax.axis_index(AXIS)
        return [jax.lax.dynamic_slice(self._padded(value, i), (index * self.chunks[i],), (self.chunks[i],))
                for i, value in enumerate(values)]

    def whole(self, pieces):
        """The whole weights from every tower's pieces (an all-gather), the
        same on every tower."""
        return [jax_compat.gathered_over(piece, AXIS)[:self.sizes[i]].reshape(self.shapes[i])
                for i, piece in enumerate(pieces)]

    def clipped(self, pieces):
        """The pieces clipped as the optimizer's clipnorm or global_clipnorm
        clips the whole gradients (`keras.optimizers.Optimizer`), each norm
        summed over every tower's pieces."""
        if not (self.clipnorm and self.clipnorm > 0) and not (self.global_clipnorm and self.global_clipnorm > 0):
            return pieces
        squares = jax.lax.psum(jnp.stack([jnp.sum(jnp.square(p.astype("float32"))) for p in pieces]), AXIS)
        if self.clipnorm and self.clipnorm > 0:
            clipped = []
            for piece, l2sum in zip(pieces, squares):
                # As Keras: a zero gradient's norm is 0 without a NaN from
                # the square root's gradient.
                l2norm = jnp.where(l2sum > 0, jnp.sqrt(jnp.where(l2sum > 0, l2sum, 1.0)), l2sum)
                clipped.append((piece * self.clipnorm) / jnp.maximum(l2norm, self.clipnorm).astype(piece.dtype))
            return clipped
        norm = jnp.sqrt(jnp.sum(squares))
        scale = self.global_clipnorm * jnp.minimum(1.0 / norm, 1.0 / self.global_clipnorm) + (norm - norm)
        return [piece * scale.astype(piece.dtype) for piece in pieces]

    def applied(self, optimizer_pieces, gradient_pieces, weight_pieces):
        """(new weight pieces, new optimizer pieces): the optimizer's update
        of this tower's pieces."""
        return tuple(map(list, self.copy.stateless_apply(
            optimizer_pieces, self.clipped(gradient_pieces), weight_pieces)))

    def _padded(self, value, i):
        flat = value.reshape(-1)
        return jnp.pad(flat, (0, self.chunks[i] * self.num_towers - flat.shape[0]))


def _host(mesh):
    """The host's CPU device where the towers are accelerators; None where
    they are CPU devices themselves (the host's memory already)."""
    if all(d.platform == "cpu" for d in mesh.devices.flat):
        return None
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS left the CPU out: they stay on the default device
        return None


def _piece_copy(optimizer, weights, chunks):
    """(the optimizer rebuilt on piece-shaped variables, each of its
    variables' weight index or None): which variables are slots is read as
    the copy makes them (`add_variable_from_reference`)."""
    config = optimizer.get_config()
    config.update(clipnorm=None, global_clipnorm=None)
    copy = type(optimizer).from_config(config)
    pieces = [keras.Variable(np.zeros((chunk,), w.dtype), dtype=w.dtype, trainable=True,
                             name=w.name) for w, chunk in zip(weights, chunks)]
    if optimizer.weight_decay:
        excluded = [p for p, w in zip(pieces, weights) if not _compat.uses_weight_decay(optimizer, w)]
        if excluded:
            copy.exclude_from_weight_decay(var_list=excluded)
    index = {id(p): i for i, p in enumerate(pieces)}
    slots = {}
    add_from_reference = copy.add_variable_from_reference

    def add_variable_from_reference(reference_variable, *args, **kwargs):
        variable = add_from_reference(reference_variable, *args, **kwargs)
        slots[id(variable)] = index[id(reference_variable)]
        return variable

    object.__setattr__(copy, "add_variable_from_reference", add_variable_from_reference)
    try:
        copy.build(pieces)
    finally:
        object.__delattr__(copy, "add_variable_from_reference")
    slot_of = [slots.get(id(v)) for v in copy.variables]
    if len(copy.variables) != len(optimizer.variables) or any(
            (tuple(o.shape) != tuple(c.shape)) if slot is None else (tuple(o.shape) != tuple(weights[slot].shape))
            for o, c, slot in zip(optimizer.variables, copy.variables, slot_of)):
        raise KerasTowerError(
            f"shard_optimizer=True: {optimizer.name} rebuilt from its config on the towers' pieces "
            f"holds other variables than it does ({[tuple(v.shape) for v in optimizer.variables]} "
            f"against {[tuple(v.shape) for v in copy.variables]}), so its state cannot be cut "
            "into pieces. Leave shard_optimizer off for this optimizer.")
    return copy, slot_of
