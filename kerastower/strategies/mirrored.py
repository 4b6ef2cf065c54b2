"""The strategies of one process: "single" (one device) and "mirrored" (one
tower per local device), and "central", which says why it is not offered.

Importing this module registers them with `kt.distributed`.
"""

from kerastower._tf import tf
from kerastower.strategies.devices import local_devices
from kerastower.errors import StrategyError
from kerastower.strategies.tf_distribute import TFDistributeStrategy
from kerastower.strategies.switch import register_strategy

__all__ = []


def _default_devices():
    """All GPUs when there are any, else every logical CPU device."""
    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        return [d.name for d in gpus]
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def _make_single(devices):
    if devices is None:
        return TFDistributeStrategy("single", tf.distribute.get_strategy())
    devices = local_devices(devices, "single")
    if len(devices) != 1:
        raise StrategyError(
            f'"single" runs one tower on one device; got devices={devices}. '
            'Use "mirrored" for several devices.'
        )
    return TFDistributeStrategy("single", tf.distribute.OneDeviceStrategy(devices[0]))


def _make_mirrored(devices):
    devices = local_devices(devices, "mirrored") if devices is not None else _default_devices()
    cross_ops = None
    if not any("GPU" in d.upper() for d in devices):
        # NCCL needs GPUs; on CPU devices a plain reduction is the only choice.
        cross_ops = tf.distribute.ReductionToOneDevice()
    return TFDistributeStrategy(
        "mirrored",
        tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_ops),
    )


def _make_central(devices):
    raise StrategyError(
        '"central" (CentralStorageStrategy: variables on one device, tensorpack\'s '
        "SyncMultiGPUTrainerParameterServer) does not work with Keras 3: Keras's "
        "metrics then count each update once per tower (wrong logs, inexact "
        "evaluation) and BatchNormalization, Dropout and every random layer fail "
        'on its variables. Use "mirrored": the same synchronous updates, with '
        "variables replicated on every tower."
    )


register_strategy("single", _make_single)
register_strategy("mirrored", _make_mirrored)
register_strategy("central", _make_central)
