"""The strategies on the JAX backend: which devices the towers run on.

`kt.distributed("single")` and `kt.distributed("mirrored")` build a
`JaxTowerStrategy`: one tower per device of a one-axis `jax.sharding.Mesh`.
Placing each tower's batch, reducing the gradients and making the towers'
weights agree happen in `backend/jax/step.py`; the strategy only says where.

Examples:
    >>> import jax
    >>> from kerastower.strategies import jax_mesh as jax_strategies
    >>> jax_strategies.make("mirrored", jax.devices()[:2]).num_towers
    2
"""

import contextlib
import functools

import jax

from kerastower.backend.jax import step as jax_step
from kerastower.errors import StrategyError

__all__ = ["JaxTowerStrategy", "make", "default", "NAMES"]

NAMES = ("single", "mirrored", "multihost")
_TENSORFLOW_ONLY = {
    "horovod": "Horovod's TensorFlow binding",
    "multiworker": "tf.distribute.MultiWorkerMirroredStrategy",
    "central": "tf.distribute's CentralStorageStrategy",
}


class JaxTowerStrategy:
    """One tower per JAX device, all in this process."""

    single_process = True
    is_chief = True

    def __init__(self, name, devices):
        self.name = name
        self.devices = list(devices)
        self.mesh = jax_step.tower_mesh(self.devices)

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


def _devices(devices, name):
    local = jax.local_devices()
    if devices is None:
        return local[:1] if name == "single" else local
    chosen = []
    for device in devices:
        if isinstance(device, int):
            if not 0 <= device < len(local):
                raise StrategyError(
                    f"kt.distributed({name!r}): device index {device} is out of range; this "
                    f"process has {len(local)} JAX devices: {local}."
                )
            device = local[device]
        elif not isinstance(device, jax.Device):
            raise StrategyError(
                f"kt.distributed({name!r}) on JAX takes jax.Device objects or indices into "
                f"jax.local_devices(); got {device!r}."
            )
        if device in chosen:
            raise StrategyError(f"kt.distributed({name!r}): device {device} is named twice.")
        chosen.append(device)
    return chosen


def make(name, devices=None):
    """The `JaxTowerStrategy` that `kt.distributed(name, devices)` names."""
    if name in _TENSORFLOW_ONLY:
        raise StrategyError(
            f'kt.distributed({name!r}) needs {_TENSORFLOW_ONLY[name]}, which the JAX '
            'backend does not have. On JAX use "mirrored" (every local device) or '
            '"multihost" (every device of every process, on jax.distributed), or run with '
            "KERAS_BACKEND=tensorflow."
        )
    if name not in NAMES:
        raise StrategyError(
            f"Unknown strategy {name!r} on the JAX backend. Valid names: "
            + ", ".join(repr(n) for n in NAMES) + "."
        )
    if name == "multihost":
        from kerastower.strategies import jax_multihost  # starts jax.distributed

        return jax_multihost.MultiHostStrategy(devices)
    chosen = _devices(devices, name)
    if name == "single" and len(chosen) != 1:
        raise StrategyError(
            f'"single" runs one tower on one device; got devices={chosen}. '
            'Use "mirrored" for several devices.'
        )
    if not chosen:
        raise StrategyError(f"kt.distributed({name!r}): no devices given.")
    return JaxTowerStrategy(name, chosen)


@functools.lru_cache(maxsize=None)
def default():
    """One tower on the first local device: what runs outside kt.distributed."""
    return JaxTowerStrategy("single", jax.local_devices()[:1])
