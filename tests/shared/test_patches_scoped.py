"""kerastower patches Keras only while one of its scopes is open.

Importing kerastower changes no Keras function; a `kt.distributed` block
and a running step put their patches in place and take them out again when
they end. Outside every kerastower scope, Keras is Keras's own: on JAX,
`BatchNormalization(synchronized=True)` built there raises Keras's own error
(kerastower admits it inside `kt.distributed`, docs/jax.md).

The check runs in a fresh process, so that Keras's originals are read
before kerastower is first imported.
"""

import json
import os
import subprocess
import sys
import textwrap

from tests.helpers.common import BACKEND

# Every Keras function kerastower patches, as (module, attribute path).
PATCHED = [
    ("keras.src.losses.loss", "scale_loss_for_distribution"),
    ("keras.src.losses.loss", "unscale_loss_for_distribution"),
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer.apply"),
    ("keras.src.optimizers.loss_scale_optimizer", "LossScaleOptimizer.apply"),
    ("keras.src.backend.tensorflow.optimizer", "TFOptimizer._all_reduce_sum_gradients"),
    ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer.fit"),
    ("keras.src.backend.jax.nn", "moments"),
    ("keras.src.layers.normalization.batch_normalization", "BatchNormalization.__init__"),
]

_SCRIPT = textwrap.dedent("""
    import importlib, json, os, sys

    import keras
    import numpy as np

    PATCHED = json.loads(sys.argv[1])
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(2)])

    def current(module, path):
        owner = importlib.import_module(module)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)

    originals = {f"{m}.{p}": current(m, p) for m, p in PATCHED}

    def changed():
        return sorted(f"{m}.{p}" for m, p in PATCHED if current(m, p) is not originals[f"{m}.{p}"])

    import kerastower as kt

    seen = {"after_import": changed()}
    if keras.backend.backend() == "tensorflow":
        two = ["/cpu:0", "/cpu:1"]
    else:
        import jax

        two = jax.devices()[:2]

    def model():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((3,))
        h = keras.layers.Dense(4, use_bias=False)(inputs)
        h = keras.layers.BatchNormalization(synchronized=True)(h)
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(h))
        model.compile(optimizer="adam", loss="mse")
        return model

    x = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    with kt.distributed("mirrored", devices=two):
        seen["inside_distributed"] = changed()
        towers = model()
        towers.fit(x, y, batch_size=4, epochs=1, verbose=0)
    seen["after_fit"] = changed()

    # Built under one tower, trained after the block: the engine's step is
    # traced outside every kt.distributed block.
    with kt.distributed("single"):
        one = model()
    one.fit(x, y, batch_size=8, epochs=1, verbose=0)
    seen["after_fit_outside_block"] = changed()
    seen["finite"] = bool(np.all(np.isfinite(one.predict(x, verbose=0))))

    try:
        keras.layers.BatchNormalization(synchronized=True)
        seen["built_outside"] = None
    except Exception as error:
        seen["built_outside"] = f"{type(error).__name__}: {error}"
    print("RESULT " + json.dumps(seen))
""")


def _run():
    env = dict(os.environ, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="2")
    if BACKEND == "jax":
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    done = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(PATCHED)], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_keras_is_its_own_outside_every_kerastower_scope():
    seen = _run()
    assert seen["after_import"] == []
    # The check sees patches: a kt.distributed block puts some in place.
    expected_inside = (
        ["keras.src.backend.jax.nn.moments",
         "keras.src.layers.normalization.batch_normalization.BatchNormalization.__init__"]
        if BACKEND == "jax" else ["keras.src.backend.tensorflow.trainer.TensorFlowTrainer.fit"])
    assert seen["inside_distributed"] == expected_inside
    assert seen["after_fit"] == []
    assert seen["after_fit_outside_block"] == []
    assert seen["finite"]
    if BACKEND == "jax":
        # Keras's own refusal, unchanged outside kerastower's scopes.
        assert seen["built_outside"] is not None
        assert "synchronized=True is only supported with the TensorFlow backend" in seen["built_outside"]
    else:
        assert seen["built_outside"] is None
