"""What the tests of both backends use: the backend, its devices, small models.

Imported first by tests/conftest.py, so each backend gets its 4 devices
before it starts: 4 logical CPU devices on TensorFlow, 4 forced host
devices on JAX. tests/shared/ runs once per backend, so that a divergence
between the backends fails there.
"""

import os
import signal

from tests.helpers import ROOT  # noqa: F401 (the tests import it from here)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if os.environ.get("KERAS_BACKEND") == "jax":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import keras  # noqa: E402

BACKEND = keras.backend.backend()

if BACKEND == "tensorflow":
    import tensorflow as tf

    _cpus = tf.config.list_physical_devices("CPU")
    if tf.config.get_logical_device_configuration(_cpus[0]) is None:
        tf.config.set_logical_device_configuration(
            _cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(4)])


def free_port():
    """A TCP port on localhost that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def tower_devices(n):
    """The devices of `n` towers on this backend: logical CPUs on
    TensorFlow, JAX's first `n` devices on JAX."""
    if BACKEND == "tensorflow":
        return [f"/cpu:{i}" for i in range(n)]
    import jax

    return jax.devices()[:n]


import kerastower as kt  # noqa: E402


class Stop(Exception):
    """What StopAt raises: a crash at a chosen step."""


class StopAt(keras.callbacks.Callback):
    """Crashes training once the loop's global step reaches `step`."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if self.model.loop.global_step >= self.step:
            raise Stop(self.step)


class SigtermAt(keras.callbacks.Callback):
    """Sends this process SIGTERM (a preemption) once the loop's global step reaches `step`."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if self.model.loop.global_step == self.step:
            signal.raise_signal(signal.SIGTERM)


def id_data(n, features=4, classes=3, seed=0):
    """n examples whose first feature is the example id (numpy arrays)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    x[:, 0] = np.arange(n)
    y = rng.integers(0, classes, n).astype("int32")
    return x, y


def endless(x, y, batch):
    """The batches of (x, y) in order, repeated without end: a Python
    generator, which both backends take with steps_per_epoch."""
    n = len(x) - len(x) % batch
    while True:
        for start in range(0, n, batch):
            yield x[start:start + batch], y[start:start + batch]


def mlp(features=4, classes=3, optimizer=None, recorder=None, **compile_kwargs):
    """A compiled 4 -> 8 -> 3 TowerModel with accuracy, in the current strategy
    (`recorder`: a layer, e.g. one noting each tower's example ids, put
    after the input)."""
    inputs = keras.Input((features,))
    h = recorder(inputs) if recorder is not None else inputs
    h = keras.layers.Dense(8, activation="tanh")(h)
    outputs = keras.layers.Dense(classes)(h)
    model = kt.TowerModel(inputs, outputs)
    model.compile(
        optimizer=optimizer or keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **compile_kwargs,
    )
    return model


def tower_copies(variable):
    """What each tower holds of a Keras variable, as floats: the
    MirroredVariable's values on TensorFlow, the replicated array's shards
    on JAX (one value where it was assigned after the last step: the next
    step puts it on every tower)."""
    if BACKEND == "tensorflow":
        return [float(v.numpy()) for v in variable.value.values]
    return [float(shard.data) for shard in variable.value.addressable_shards]


def assert_logs_equal(got, want, atol, what):
    """Two `History.history` (or evaluate) dicts log the same keys, their
    values within `atol` (relative and absolute); `what` names the pair."""
    import numpy as np

    assert sorted(got) == sorted(want), f"{what}: logged {sorted(got)}, expected {sorted(want)}"
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=atol, atol=atol, err_msg=f"{what}: {key}")
