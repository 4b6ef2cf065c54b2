"""The strategies on the JAX backend: which devices the towers run on.

`kt.distributed("single")` and `kt.distributed("mirrored")` build a
`JaxTowerStrategy` (jax_local.py): one tower per device of a one-axis
`jax.sharding.Mesh`; `kt.distributed("multihost")` its multi-process kind
(jax_multihost.py). Importing this module registers those names, and what
`kt.distributed` needs of JAX besides (switch.py): one tower on the first
device outside every block, and an open block admitting synchronized
BatchNormalization (backend/jax/sync.py).
Placing each tower's batch, reducing the gradients and making the towers'
weights agree happen in `backend/jax/step.py`; the strategy only says where.

Examples:
    >>> import jax
    >>> from kerastower.strategies import jax_mesh as jax_strategies
    >>> jax_strategies.make("mirrored", jax.devices()[:2]).num_towers
    2
"""

import functools
import re

import jax

from kerastower.arguments import integer
from kerastower.backend.jax import sync
from kerastower.errors import StrategyError
from kerastower.strategies import switch
from kerastower.strategies.jax_local import JaxTowerStrategy
from kerastower.strategies.jax_multihost import MultiHostStrategy

__all__ = ["make", "default", "use_cpu_towers", "NAMES"]

NAMES = ("single", "mirrored", "multihost")
_TENSORFLOW_ONLY = {
    "horovod": "Horovod's TensorFlow binding",
    "multiworker": "tf.distribute.MultiWorkerMirroredStrategy",
    "central": "tf.distribute's CentralStorageStrategy",
}


def use_cpu_towers(num_towers):
    """Gives JAX `num_towers` CPU devices; returns their names, "/cpu:0", ...

    What `kt.use_cpu_towers` is on JAX: the same script splits the CPU on
    either backend. JAX takes its number of CPU devices when it starts (its
    first array or computation), so call it first thing; once JAX has
    started with at least `num_towers` CPU devices (or XLA_FLAGS'
    `--xla_force_host_platform_device_count` gave them), it returns the
    first ones.

    Examples:
        >>> devices = kt.use_cpu_towers(2)      # first thing in the program
        >>> devices
        ['/cpu:0', '/cpu:1']
        >>> with kt.distributed("mirrored", devices=devices) as strategy:
        ...     print(strategy.num_towers)
        2
    """
    num_towers = integer(num_towers, "num_towers", "use_cpu_towers", minimum=1)
    names = [f"/cpu:{index}" for index in range(num_towers)]
    asked = max(num_towers, jax.config.jax_num_cpu_devices, _forced_host_devices())
    try:
        jax.config.update("jax_num_cpu_devices", asked)
    except RuntimeError:  # JAX has started: its devices are fixed
        made = jax.local_devices(backend="cpu")
        if len(made) < num_towers:
            raise StrategyError(
                f"use_cpu_towers({num_towers}): JAX has already started with {len(made)} CPU "
                "device(s), and its devices cannot change after it starts. Call "
                "kt.use_cpu_towers first thing in the program, before any JAX or Keras "
                "computation (creating a model or an array starts JAX), or set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={num_towers} before the program starts."
            ) from None
    return names


def _forced_host_devices():
    """The CPU devices XLA_FLAGS asks for, 0 where it does not."""
    import os

    found = re.findall(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else 0


_DEVICE_NAME = re.compile(r"^/(?:device:)?(cpu|gpu|tpu):(\d+)$", re.IGNORECASE)


def _named_device(device, name):
    """The local JAX device a TensorFlow-style name ("/cpu:1", "/gpu:0",
    "/device:GPU:0") names, so that a script's device list serves both backends."""
    match = _DEVICE_NAME.match(device.strip())
    if match is None:
        raise StrategyError(
            f"kt.distributed({name!r}): {device!r} is not a device name. On JAX name devices "
            'as "/cpu:0" or "/gpu:1", or pass jax.Device objects or indices into '
            "jax.local_devices()."
        )
    platform, index = match.group(1).lower(), int(match.group(2))
    try:
        of_platform = jax.local_devices(backend=platform)
    except RuntimeError:
        of_platform = []
    if index >= len(of_platform):
        raise StrategyError(
            f"kt.distributed({name!r}): {device!r} does not exist: this process has "
            f"{len(of_platform)} JAX {platform.upper()} device(s) ({of_platform}). "
            + ("For several CPU towers, call kt.use_cpu_towers(N) first thing in the program."
               if platform == "cpu" else "Name devices this process has.")
        )
    return of_platform[index]


def _devices(devices, name):
    local = jax.local_devices()
    if devices is None:
        return local[:1] if name == "single" else local
    if isinstance(devices, (str, bytes)):
        raise StrategyError(f"kt.distributed({name!r}): devices is the string {devices!r}, not "
                            f"a list of devices. Write devices=[{devices!r}].")
    chosen = []
    for device in devices:
        if isinstance(device, str):
            device = _named_device(device, name)
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
        raise StrategyError(_tensorflow_only_hint(name))
    if name not in NAMES:
        raise StrategyError(
            f"Unknown strategy {name!r} on the JAX backend. Valid names: "
            + ", ".join(repr(n) for n in NAMES) + "."
        )
    if name == "multihost":
        return MultiHostStrategy(devices)  # starts jax.distributed
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


def _tensorflow_only_hint(name):
    return (f'kt.distributed({name!r}) needs {_TENSORFLOW_ONLY[name]}, which the JAX backend does '
            'not have. On JAX use "mirrored" (every local device) or "multihost" (every device of '
            'every process, on jax.distributed), or run with KERAS_BACKEND=tensorflow.')


switch.register_backend("jax", switch.BackendStrategies(
    default=default,
    block_patches=sync.SYNCHRONIZED_BATCHNORM,
    hints={name: _tensorflow_only_hint(name) for name in _TENSORFLOW_ONLY},
))
for _name in NAMES:
    switch.register_strategy(_name, functools.partial(make, _name), backend="jax")
