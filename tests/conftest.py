"""Shared set-up: 4 logical CPU devices, made before TensorFlow starts."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(4)]
)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import kerastower as kt  # noqa: E402

TWO = ["/cpu:0", "/cpu:1"]


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(1234)
    yield


@pytest.fixture
def two_towers():
    with kt.distributed("mirrored", devices=TWO) as strategy:
        yield strategy


class Recorder(keras.layers.Layer):
    """Identity layer that records, per tower, the example ids it was fed.

    The first feature of every example is its id. What a tower "saw" is what
    actually flowed through its replica of the model.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = {}
        self.shapes = {}

    def call(self, x, training=None):
        ctx = kt.get_current_tower_context()
        if ctx is None:
            return x
        key = (ctx.name, ctx.index, ctx.total, ctx.is_training)

        def record(ids, shape):
            self.seen.setdefault(key, []).append(np.asarray(ids).astype(int).tolist())
            self.shapes.setdefault(key, []).append(tuple(np.asarray(shape).tolist()))
            return np.int32(0)

        flat = tf.reshape(x, [tf.shape(x)[0], -1])
        token = tf.numpy_function(record, [flat[:, 0], tf.shape(x)], tf.int32, stateful=True)
        with tf.control_dependencies([token]):
            return tf.identity(x)


# What tests/ and tests_shared/ both use: the crash at a chosen step, the
# data whose first feature is the example id, the small model.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests_shared"))
from shared_helpers import Stop, StopAt, id_data  # noqa: E402,F401
from shared_helpers import mlp as _shared_mlp  # noqa: E402


def mlp(recorder=None, **kwargs):
    """shared_helpers.mlp, with `recorder` (e.g. `IdRecorder`) after the input."""
    return _shared_mlp(recorder=recorder, **kwargs)
