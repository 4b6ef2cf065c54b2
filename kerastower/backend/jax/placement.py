"""Where a tower gets its batch on JAX: one device per tower, one sharded array per step.

The towers are the devices of a one-axis mesh (axis `AXIS`), in tower order.
Each step's batches, one per tower, are put each on its tower's device and
assembled, without a host-side join, into one array sharded over the towers;
across processes ("multihost"), each process places its own towers' batches.

Examples:
    >>> import jax
    >>> from kerastower.engine.jax_placement import tower_mesh, place_tower_batches
    >>> mesh = tower_mesh(jax.devices()[:1])
    >>> (x,) = place_tower_batches(mesh, [(np.ones((4, 3)),)])
    >>> x.shape
    (4, 3)
"""

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from kerastower.errors import DataMismatchError

__all__ = ["AXIS", "REPLICATED", "BY_TOWER", "BY_STEP_AND_TOWER", "tower_mesh", "place_tower_batches",
           "spans_processes", "local_value"]

AXIS = "towers"
REPLICATED = PartitionSpec()
BY_TOWER = PartitionSpec(AXIS)
BY_STEP_AND_TOWER = PartitionSpec(None, AXIS)  # [steps, towers, ...]: several steps' values


def tower_mesh(devices):
    """A one-axis mesh with one tower per device, in tower order."""
    return Mesh(np.array(devices, dtype=object), (AXIS,))


def spans_processes(mesh):
    """True when some of the mesh's towers run in other processes (multihost)."""
    return any(d.process_index != jax.process_index() for d in mesh.devices.flat)


def place_tower_batches(mesh, batches):
    """One array per leaf, sharded over the towers, from one batch per tower:
    tower i's batch is put on device i as it is. Across processes, each
    process places the batches of its own towers only."""
    shapes = [[np.shape(leaf) for leaf in jax.tree.leaves(batch)] for batch in batches]
    if any(shape != shapes[0] for shape in shapes):
        raise DataMismatchError(
            f"On the JAX backend the towers of one step need batches of one shape "
            f"(one sharded array); got {shapes}. Give every tower the same batch "
            "size, or train on one device."
        )
    sharding = NamedSharding(mesh, BY_TOWER)
    if mesh.size == 1:
        return jax.device_put(batches[0], sharding)
    towers = [(device, batch) for device, batch in zip(mesh.devices.flat, batches)
              if device.process_index == jax.process_index()]
    # One device_put for every leaf of every tower: one dispatch, not one each.
    leaves = [jax.tree.leaves(batch) for _, batch in towers]
    placed = jax.device_put(leaves, [[device] * len(row) for (device, _), row in zip(towers, leaves)])

    def join(index, leaf):
        first = np.shape(leaf)
        return jax.make_array_from_single_device_arrays(
            (first[0] * mesh.size,) + tuple(first[1:]), sharding, [row[index] for row in placed])

    structure = jax.tree.structure(towers[0][1])
    return jax.tree.unflatten(structure, [join(i, leaf) for i, leaf in enumerate(leaves[0])])


def local_value(value):
    """A replicated array as this process's own copy (a numpy array when
    its devices span processes: the model's variables stay local)."""
    if getattr(value, "is_fully_addressable", True):
        return value
    return np.asarray(value.addressable_data(0))
