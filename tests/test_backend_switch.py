"""The same seed gives the same run on TensorFlow and on JAX.

Which rows of numpy arrays each tower takes, and in which order every pass
reads them, is decided once for both backends (kerastower/inputs/array_rows.py):
a script trained with shuffled arrays on TensorFlow and then on JAX (as
after a backend switch) sees the same batches and ends at the same weights.
"""

import json
import os
import subprocess
import sys

import numpy as np

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "backend_switch_script.py")


def _run(backend, epochs):
    env = dict(os.environ, KERAS_BACKEND=backend,
               XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(SCRIPT)),
                                                        os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, SCRIPT, str(epochs)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_shuffled_arrays_train_alike_on_tensorflow_and_jax():
    tf_run, jax_run = _run("tensorflow", 3), _run("jax", 3)
    np.testing.assert_allclose(tf_run["loss"], jax_run["loss"], rtol=1e-5, atol=1e-6)
    for tf_weight, jax_weight in zip(tf_run["weights"], jax_run["weights"]):
        np.testing.assert_allclose(tf_weight, jax_weight, rtol=1e-5, atol=1e-6)
