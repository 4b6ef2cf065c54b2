"""`JaxTowerStrategy`: one tower per JAX device, all in this process.

What `kt.distributed("single")` and `kt.distributed("mirrored")` make on
JAX (jax_mesh.py chooses the devices), and the base of "multihost"'s
strategy (jax_multihost.py).
"""

import contextlib

from kerastower.backend.jax.placement import tower_mesh

__all__ = ["JaxTowerStrategy"]


class JaxTowerStrategy:
    """One tower per JAX device, all in this process."""

    single_process = True
    is_chief = True

    def __init__(self, name, devices):
        self.name = name
        self.devices = list(devices)
        self.mesh = tower_mesh(self.devices)

    @property
    def num_towers(self):
        return len(self.devices)

    def scope(self):
        # Keras variables on JAX live on the default device; each step puts
        # the state on the towers' devices itself.
        return contextlib.nullcontext()

    def broadcast_object(self, obj):
        return obj

    def all_agree(self, flag):
        return bool(flag)

    def sum_over_processes(self, values):
        return [int(v) for v in values]

    def sync_initial_state(self, model):
        """Nothing to do: one process, one copy of the variables."""

    def seed_towers_apart(self, model):
        """Nothing to do: each step moves tower i's seeds by i (jax_step)."""

    def step_devices(self, num_towers):
        """The devices of a step on `num_towers` towers: the first ones (a
        pass's short last step runs on fewer)."""
        return self.devices[:num_towers]

    def agree_on_seed(self, seed):
        """The shuffling seed every process uses: here, `seed`."""
        return seed

    def __repr__(self):
        return f"JaxTowerStrategy({self.name!r}, towers={self.num_towers})"
