"""What the towers hold between JAX training calls, and when the model's variables get it.

The jitted steps (step.py) take the training state (trainable weights,
non-trainable weights, optimizer slots, every tower's metric variables) as
arguments and give back the next one. `TowerState` keeps that state on the
towers' devices from call to call, writes it into the model's variables
when something reads them (`sync`: an epoch's end, a callback touching
`self.model`), and notices when a callback set a variable or reset the
metrics since (`generation`), so the next call starts from what the user
set.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kerastower._compat import on_jax as jax_compat
from kerastower.backend.jax.optimizer_shards import OptimizerShards
from kerastower.backend.jax.placement import BY_TOWER
from kerastower.backend.jax.placement import REPLICATED
from kerastower.backend.jax.placement import local_value
from kerastower.backend.jax.placement import spans_processes

__all__ = ["TowerState", "LAUNCH_AHEAD_MAX_BYTES", "LAUNCH_AHEAD_MAX_BYTES_CPU", "bytes_per_device"]


# A call launched ahead cannot take the state it starts from as its own
# (donated), so it writes a new one: up to three states live at once (the
# one computed, the one held, the one the variables got at a sync). On
# accelerators that is memory only; above this size a step takes long
# enough that the host's work between steps costs little.
LAUNCH_AHEAD_MAX_BYTES = 1 << 30
# On a CPU each new state is fresh host memory, paid in page faults: on a
# 2-core VM, 0.07 ms per MiB (a 1024-wide MLP's 22 MiB of weights and Adam
# slots took 1.9 ms more a step), against about 0.1 ms of host work that
# launching ahead hides. The step that keeps its state also copies it
# through the check's cond (docs/performance.md): writing into a spare
# state's buffers instead of new ones still ran at 0.83 of a donated step.
LAUNCH_AHEAD_MAX_BYTES_CPU = 1 << 20


def _each_array_once(state):
    """`state` with each array that appears in it again copied: two
    variables may hold one array (`a.assign(b)` stores `b`'s; an optimizer's
    EMA written into the weights), and a step that takes its state as its
    own may take each buffer once (XLA refuses to donate one twice)."""
    seen = set()

    def once(value):
        if id(value) in seen:
            return jnp.array(value, copy=True)
        seen.add(id(value))
        return value

    return jax.tree.map(once, state)


def bytes_per_device(values):
    """{device: bytes of `values` it holds}, read from each array's buffers
    on each device (a value whole on every device counts on each)."""
    held = {}
    for value in values:
        for shard in value.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


class TowerState:
    """The training state `mesh`'s towers hold between the steps of
    `model`, and its way into the model's variables.

    The state lives on the towers' devices between steps. The model's
    variables get it when something reads them (`sync`); a variable set
    since (by a callback) is read back before the next step.
    """

    def __init__(self, model, mesh, check_finite=True, shard_optimizer=False):
        self.model = model
        self.mesh = mesh
        self.num_towers = mesh.size
        self.check_finite = check_finite
        self._tower_metrics = None
        self._summed_metrics = None  # their sum over the towers, replicated
        self._metrics_written = None  # the _summed_metrics last written into the model's
        self._held = None
        self._written = None  # what `sync` left in the variables (see _check_written)
        self._inference = None  # (the variables' values, them placed): `_inference_state`
        self._inference_variables = None  # their lists, during one evaluate or predict
        self._generation = 0
        self._launches_ahead = None
        # Set by fit's feed (`FitSteps.batch_hooks`, each epoch): its calls
        # come back before their flags are read, so none waits for the one
        # before.
        self.flags_read_late = False
        self._stack_metrics = None
        self._spans = spans_processes(mesh)
        self._host_memory = all(d.platform == "cpu" for d in mesh.devices.flat)
        # Each tower keeps its piece of the optimizer's state (one tower: the whole).
        self._shard_optimizer = shard_optimizer and self.num_towers > 1
        self._shards = None
        self._optimizer_bytes = None  # what the held optimizer state took on each device

    def optimizer_shards(self):
        """The `OptimizerShards` the towers cut the optimizer's state by, or
        None where each tower holds it whole."""
        optimizer = getattr(self.model, "optimizer", None)
        if self._shards is None and self._shard_optimizer and optimizer is not None:
            if not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            self._shards = OptimizerShards(optimizer, self.num_towers)
        return self._shards

    def optimizer_state_bytes(self):
        """{device: bytes of optimizer state it holds for the steps}, read
        from the buffers: what the towers hold; else what they held last
        (measured at the sync that handed it to the variables, `sync`);
        else the optimizer's variables placed as a step places them."""
        if self._held is not None:
            return bytes_per_device(self._held[2])
        if self._optimizer_bytes is None:
            self._optimizer_bytes = bytes_per_device(self._current_state()[2])
        return dict(self._optimizer_bytes)

    def _replicated(self, values):
        sharding = NamedSharding(self.mesh, REPLICATED)
        # Across processes, every process puts its own copy of the same value.
        # One device_put for all: JAX's per-call cost is most of a small
        # model's epoch when paid per variable.
        values = [np.asarray(v) if self._spans else v for v in values]
        if all(getattr(v, "sharding", None) == sharding for v in values):
            # Placed so already (what the steps gave back, written into the
            # variables): device_put would hand back the same buffers, at a
            # cost per call a small model's fit feels. Values placed
            # otherwise are put, or the step would be compiled again for
            # their sharding.
            return list(values)
        return list(jax.device_put(values, [sharding] * len(values))) if values else []

    def _on_mesh_device(self, values):
        """Whether the mesh is one device and every value lives on it."""
        if self.num_towers != 1:
            return False
        device = self.mesh.devices.flat[0]
        return all(isinstance(v, jax.Array) and v.devices() == {device} for v in values)

    def reset_metrics(self):
        """Every tower's metric variables start again from the model's."""
        self._tower_metrics = self._summed_metrics = None
        self._generation += 1

    def metric_values(self):
        """What the towers' metrics hold, for `restore_metric_values`."""
        return self._tower_metrics, self._summed_metrics

    def restore_metric_values(self, values):
        self._tower_metrics, self._summed_metrics = values
        self._generation += 1

    def _metric_state(self):
        if self._tower_metrics is None:
            # Tower 0 holds what the model's metrics hold, the others zeros:
            # their sum is the model's.
            values = [v.value for v in self.model.metrics_variables]
            sharding = NamedSharding(self.mesh, BY_TOWER)
            if self._spans:
                stacked = [np.stack([np.asarray(v)] + [np.zeros(v.shape, v.dtype)] * (self.num_towers - 1))
                           for v in values]
                self._tower_metrics = list(jax.device_put(stacked, [sharding] * len(stacked)))
            else:
                # Stacked on the devices: reading the values back to the
                # host would wait for the step in flight (every epoch).
                if self._stack_metrics is None:
                    towers = self.num_towers
                    self._stack_metrics = jax.jit(lambda values: [
                        jnp.concatenate([v[None], jnp.zeros((towers - 1,) + v.shape, v.dtype)]) for v in values
                    ], out_shardings=sharding)
                # The values may live on another mesh's devices (a short
                # last step's). On one device they are read where they are:
                # a device_put per epoch cost a small model's fit 0.1 ms.
                if not self._on_mesh_device(values):
                    values = self._replicated(values)
                self._tower_metrics = list(self._stack_metrics(values)) if values else []
        return self._tower_metrics

    def _write_back(self, variables, values):
        # Only this process's copies: a sync needs no other process, so a
        # callback of the chief alone may trigger it.
        for variable, value in zip(variables, values):
            variable.assign(local_value(value))

    # The weights stay on the towers' devices from step to step, and reach
    # the model's variables only when something reads them (`sync`, which
    # Keras calls when a callback touches `self.model`): writing every
    # variable back after every step cost more than a small model's step.
    def _variable_lists(self):
        model = self.model
        optimizer = getattr(model, "optimizer", None)  # predict needs no compile()
        return (model.trainable_variables, model.non_trainable_variables,
                [] if optimizer is None else optimizer.variables)

    def _check_written(self):
        """Drops the held state when a variable it was written into (`sync`)
        holds another value now: a callback set it."""
        if self._written is None:
            return
        # By list: a layer frozen since moves variables from one to another.
        now = [[v.value for v in variables] for variables in self._variable_lists()]
        if [len(values) for values in now] != [len(values) for values in self._written] or any(
                a is not b for values, written in zip(now, self._written) for a, b in zip(values, written)):
            self._held = None
            self._generation += 1
        # Checked once per sync: the steps' next commit replaces the state.
        self._written = None

    def _current_state(self):
        """What the towers hold, else the model's variables (not kept: the
        user may set them before the next call)."""
        self._check_written()
        if self._held is not None:
            return self._held
        lists = self._variable_lists()
        trainable, non_trainable, optimizer = ([v.value for v in variables] for variables in lists)
        shards = self.optimizer_shards()
        if shards is None:
            return _each_array_once(tuple(map(self._replicated, (trainable, non_trainable, optimizer))))
        placed = shards.placed(optimizer, self.mesh)
        shards.keep_on_host(lists[2], self.mesh)
        return _each_array_once((self._replicated(trainable), self._replicated(non_trainable), placed))

    def _inference_state(self):
        """(trainable, non-trainable) for the evaluation and prediction
        steps, which change neither: what the towers hold, else the model's
        variables placed once for as long as they hold the same values (a
        callback that sets one makes the next step place them again). An
        evaluation's steps placed every variable again each: 0.6 ms a step
        of a small MLP whose step takes 0.3."""
        self._check_written()
        if self._held is not None:
            return self._held[:2]
        variables = self._inference_variables or self._variable_lists()[:2]
        stored = [jax_compat.stored_values(some) for some in variables]
        cached = self._inference
        if cached is None or any(len(a) != len(b) or any(x is not y for x, y in zip(a, b))
                                 for a, b in zip(cached[0], stored)):
            placed = _each_array_once(tuple(self._replicated([v.value for v in some]) for some in variables))
            cached = self._inference = (stored, placed)
        return cached[1]

    def keep_inference_changes(self, positions, values):
        """Carries the non-trainable `values` an evaluation or prediction
        step changed (at `positions`: a SeedGenerator's state) on to the
        next step and into the model, as stock Keras-JAX carries them."""
        if not positions:
            return
        if self._held is not None:
            held = list(self._held)
            non_trainable = list(held[1])
            for i, value in zip(positions, values):
                non_trainable[i] = value
            held[1] = non_trainable
            # `sync` writes them into the variables (evaluate's and predict's end).
            self._held, self._written = tuple(held), None
            return
        variables = (self._inference_variables or self._variable_lists()[:2])[1]
        for i, value in zip(positions, values):
            variables[i].assign(value)

    def inference_variables_kept(self, kept):
        """With `kept`, the model's variable lists are walked once for the
        evaluation or prediction steps that follow (a walk of a small
        model's layers cost 40 us a step), until called without."""
        if not kept:
            self._inference_variables = None
        elif self._inference_variables is None:
            self._inference_variables = self._variable_lists()[:2]

    def sync(self):
        """Writes what the towers hold into the model's variables. The next
        step reads the variables again if a callback set one since."""
        if self._held is not None and self._written is None:
            lists = self._variable_lists()
            held = list(self._held)
            if self._optimizer_bytes is None:
                # Its layout is the same at every step: measured once.
                self._optimizer_bytes = bytes_per_device(held[2])
            if self._shards is not None:
                held[2] = self._shards.whole_values(held[2], self.mesh)
            for variables, values in zip(lists, held):
                self._write_back(variables, values)
            if self.launches_ahead():
                # The steps do not take the held state as their own, so it
                # may stay theirs while the variables hold it unchanged:
                # an epoch's end then costs the next step no placement.
                self._written = [[v.value for v in variables] for variables in lists]
            else:
                self._held = None
                self._generation += 1
        self._write_metrics()

    def _write_metrics(self):
        # Once per new value: fit syncs at every epoch's end and again at
        # its own, and each assign costs a small model's fit about 10 us.
        if self._summed_metrics is not None and self._summed_metrics is not self._metrics_written:
            self._write_back(self.model.metrics_variables, self._summed_metrics)
            self._metrics_written = self._summed_metrics

    def launches_ahead(self):
        """Whether the next call may be launched before this one's finite
        flags are read, and so whether the training steps take the state
        they start from as their own (donated) or not: only where a flag is
        waited for (checked, and not `flags_read_late`: where a call comes
        back before its flags are read, the next one is launched at once
        anyway, and a state not donated is only a new one to allocate), in
        one process (a callback's sync that drops the launch must not make
        one process run a call the others do not), and where holding the
        state twice costs less than it hides (`LAUNCH_AHEAD_MAX_BYTES`,
        `LAUNCH_AHEAD_MAX_BYTES_CPU`). The size is weighed once, at the
        first step; each way has its own compiled step."""
        if self._launches_ahead is None:
            size = sum(int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize
                       for variables in self._variable_lists() for v in variables)
            limit = LAUNCH_AHEAD_MAX_BYTES_CPU if self._host_memory else LAUNCH_AHEAD_MAX_BYTES
            self._launches_ahead = self.check_finite and not self._spans and size <= limit
        return self._launches_ahead and not self.flags_read_late

    def generation(self):
        """Counts the times the state was replaced: by a commit, or from
        outside the steps (a variable a callback set; metrics reset or
        restored). Steps launched in an older one started from a stale
        state."""
        self._check_written()
        return self._generation
