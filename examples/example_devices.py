"""Where the examples put their towers: on GPUs when there are any, else on
logical devices the CPU is split into (so the multi-tower path runs anywhere)."""

import tensorflow as tf

import kerastower as kt


def tower_devices(cpu_towers, gpu_towers=None):
    """Device names for the towers; call it before TensorFlow starts.

    Args:
        cpu_towers: logical CPU devices to make when there is no GPU.
        gpu_towers: how many GPUs to use (default: all).
    """
    if tf.config.list_physical_devices("GPU"):
        return [d.name for d in tf.config.list_logical_devices("GPU")][:gpu_towers]
    return kt.use_cpu_towers(cpu_towers)
