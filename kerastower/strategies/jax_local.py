"""`JaxTowerStrategy`: one tower per JAX device, all in this process.

What `kt.distributed("single")` and `kt.distributed("mirrored")` make on
JAX (jax_mesh.py chooses the devices), and the base of "multihost"'s
strategy (jax_multihost.py).
"""

from kerastower.backend.jax.placement import tower_mesh
from kerastower.strategies.base import TowerStrategy

__all__ = ["JaxTowerStrategy"]


class JaxTowerStrategy(TowerStrategy):
    """One tower per JAX device, all in this process.

    Keras's variables on JAX live on the default device (`scope` is none);
    each step puts the state on the towers' devices and moves tower i's
    seeds by i itself (backend/jax/step.py).

    Args:
        name: the registry name this strategy was made from.
        devices: the towers' `jax.Device`s, tower 0 first.

    Examples:
        >>> import jax
        >>> from kerastower.strategies.jax_local import JaxTowerStrategy
        >>> JaxTowerStrategy("mine", jax.devices()[:2])
        JaxTowerStrategy('mine', towers=2)
    """

    def __init__(self, name, devices):
        super().__init__(name)
        self.devices = list(devices)
        self.mesh = tower_mesh(self.devices)

    @property
    def num_towers(self):
        return len(self.devices)

    def _shard_optimizer_state(self):
        """Every tower is in this process: the JAX step cuts the optimizer's
        state over them (backend/jax/optimizer_shards.py)."""

    def step_devices(self, num_towers):
        """The devices of a step on `num_towers` towers: the first ones (a
        pass's short last step runs on fewer)."""
        return self.devices[:num_towers]

    def agree_on_seed(self, seed):
        """The shuffling seed every process uses: here, `seed`."""
        return seed
