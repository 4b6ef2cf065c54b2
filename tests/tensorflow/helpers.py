"""What the TensorFlow tests share: the towers' devices and the per-tower recorder."""

import keras
import numpy as np
import tensorflow as tf

import kerastower as kt

from tests.helpers.common import Stop, StopAt, id_data  # noqa: F401 (the tests import them from here)
from tests.helpers.common import mlp as _shared_mlp

TWO = ["/cpu:0", "/cpu:1"]


def launch_workers(zygote, script, out, *args, workers=2):
    """Starts `script OUT ARGS` as the workers of a MultiWorkerMirroredStrategy
    cluster on loopback (TF_CONFIG set for each), forked by the zygote;
    returns the runs, worker 0 first."""
    import json

    from tests.helpers.common import free_port

    addresses = [f"localhost:{free_port()}" for _ in range(workers)]
    return [zygote.start(script, [out, *args], output=f"{out}/worker{index}-{'-'.join(args)}.log",
                         env={"TF_CONFIG": json.dumps({"cluster": {"worker": addresses},
                                                       "task": {"type": "worker", "index": index}})})
            for index in range(workers)]


def worker_outputs(runs, timeout=300):
    """Each worker's output once all have ended. A worker still running
    after `timeout` seconds fails the test with every worker's output
    (which worker waited where), after killing them all."""
    import pytest

    try:
        for run in runs:
            run.wait(timeout)
    except TimeoutError:
        for run in runs:
            run.kill()
        pytest.fail(f"a worker was still running after {timeout} s; their outputs:\n"
                    + "\n".join(f"--- worker {i} ---\n{run.stdout[-3000:]}" for i, run in enumerate(runs)))
    return [run.stdout for run in runs]


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


def mlp(recorder=None, **kwargs):
    """tests.helpers.common.mlp, with `recorder` (e.g. `Recorder()`) after the input."""
    return _shared_mlp(recorder=recorder, **kwargs)
