"""`kt.distributed("multihost")` on JAX: one tower per device of every process.

Every process runs the same script. `jax.distributed` joins them: from
`jax.distributed.initialize()` called by the user beforehand, else from
the environment (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
`JAX_PROCESS_ID`, or a cluster JAX recognises: SLURM, Open MPI, ...). The
towers are every device of every process, in process order. Each process
reads the input as every other does (arrays, a generator, a PyDataset: the
same batches in the same order) and places the batches of its own towers;
one jitted step then runs across the processes, so gradients are reduced
over all towers, and every process ends the step with the same weights.
The chief (process 0) writes checkpoints and prints.

A pass's short last step (fewer examples than a whole step) runs on each
process's own devices, the same step in every process, so the processes
stay equal without exchanging anything.

```python
# on each of 2 hosts (here: 2 processes of one machine)
#   JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=<0|1> python train.py
import os; os.environ["KERAS_BACKEND"] = "jax"
import keras, numpy as np, kerastower as kt

with kt.distributed("multihost"):
    inputs = keras.Input((8,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="adam", loss="mse")
keras.utils.set_random_seed(0)                         # the same data everywhere
model.fit(np.ones((256, 8)), np.ones((256, 1)), batch_size=8)   # 8 per tower
```
"""

import os
import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils

from kerastower.errors import DataMismatchError
from kerastower.errors import StrategyError
from kerastower.strategies.base import TowerStrategy
from kerastower.strategies.jax_local import JaxTowerStrategy
from kerastower.checkpoint.training_state import training_state

__all__ = ["MultiHostStrategy", "start_distributed"]


def _environment_integer(name):
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise StrategyError(f"{name}={value!r} is not an integer.") from None


def start_distributed():
    """Joins this process to the others with `jax.distributed`, once."""
    if jax.distributed.is_initialized():
        return
    # CPU devices reduce across processes only with a collectives library.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=os.environ.get("JAX_COORDINATOR_ADDRESS"),
            num_processes=_environment_integer("JAX_NUM_PROCESSES"),
            process_id=_environment_integer("JAX_PROCESS_ID"),
        )
    except (RuntimeError, ValueError) as error:
        raise StrategyError(
            'kt.distributed("multihost") could not start jax.distributed: '
            f"{error}\nEvery process needs the coordinator's address, the number of "
            "processes and its own id: set JAX_COORDINATOR_ADDRESS=host:port, "
            "JAX_NUM_PROCESSES and JAX_PROCESS_ID (or call jax.distributed.initialize "
            "yourself), before anything in the process uses JAX: creating a Keras "
            "model or variable does."
        ) from error


class MultiHostStrategy(JaxTowerStrategy):
    """One tower per device of every process joined by `jax.distributed`."""

    single_process = False

    def __init__(self, devices=None):
        if devices is not None:
            raise StrategyError(
                f'kt.distributed("multihost") runs a tower on every device of every '
                f"process; got devices={devices!r}. Choose each process's devices "
                "with CUDA_VISIBLE_DEVICES or JAX_LOCAL_DEVICE_IDS instead."
            )
        start_distributed()
        ordered = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        super().__init__("multihost", ordered)
        self.process_index = jax.process_index()
        self.local_devices = [d for d in ordered if d.process_index == self.process_index]

    @property
    def is_chief(self):
        return self.process_index == 0

    def _shard_optimizer_state(self):
        # The pieces would span processes, and a sync (the chief's callback
        # alone may ask for one) would need every process to gather them.
        TowerStrategy._shard_optimizer_state(self)

    def step_devices(self, num_towers):
        """Every device for a whole step; for a short one, this process's own
        first `num_towers` (each process runs that step itself)."""
        if num_towers == self.num_towers:
            return self.devices
        if num_towers <= len(self.local_devices):
            return self.local_devices[:num_towers]
        raise DataMismatchError(
            f"A step with batches for {num_towers} of the {self.num_towers} towers: under "
            f'"multihost", a short step runs on each process\'s own devices, and this '
            f"process has {len(self.local_devices)}. Give every tower a whole batch "
            "(steps_per_epoch with an endless input, or a generator whose length is a "
            "multiple of the number of towers)."
        )

    def broadcast_object(self, obj):
        """The chief's `obj` (picklable), on every process."""
        payload = np.frombuffer(pickle.dumps(obj), np.uint8)
        size = int(multihost_utils.broadcast_one_to_all(np.int64(payload.size)))
        buffer = payload if self.is_chief else np.zeros(size, np.uint8)
        return pickle.loads(np.asarray(multihost_utils.broadcast_one_to_all(buffer)).tobytes())

    def all_agree(self, flag):
        flags = multihost_utils.process_allgather(np.asarray(bool(flag)))
        return bool(np.all(flags))

    def sum_over_processes(self, values):
        gathered = multihost_utils.process_allgather(np.asarray([int(v) for v in values], np.int64))
        return [int(v) for v in np.asarray(gathered).reshape(-1, len(values)).sum(axis=0)]

    def agree_on_seed(self, seed):
        """The chief's shuffling seed, so every process reads the same order."""
        return self.broadcast_object(seed)

    def sync_initial_state(self, model):
        """Every process starts from the chief's variables (a restored
        checkpoint included) and optimizer state."""
        model.jax_state_sync()
        variables = training_state(model)
        values = multihost_utils.broadcast_one_to_all([np.asarray(v.value) for v in variables])
        for variable, value in zip(variables, values):
            variable.assign(np.asarray(value))

    def __repr__(self):
        return (f"MultiHostStrategy(towers={self.num_towers}, process={self.process_index}"
                f" of {jax.process_count()})")
