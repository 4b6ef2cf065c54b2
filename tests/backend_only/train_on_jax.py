"""The README's first example on JAX, run where only kerastower's `jax` extra
is installed: 2 towers train with fit and evaluate, and TensorFlow is never
imported, nor even tried.

scripts/test-backend-only.sh runs it with KERAS_BACKEND=jax and
XLA_FLAGS=--xla_force_host_platform_device_count=2 (JAX's 2 host devices are
the towers: `kt.use_cpu_towers` is TensorFlow's). It also runs where
TensorFlow is installed, and then checks that it stays unimported.
"""

import importlib.abc
import os
import sys
import traceback


class TensorFlowImports(importlib.abc.MetaPathFinder):
    """Records every attempt to import TensorFlow, and where it came from."""

    def __init__(self):
        self.attempts = []

    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow":  # its submodules come only after it
            stack = [
                frame for frame in traceback.extract_stack()[:-1]
                if "importlib" not in frame.filename and not frame.filename.startswith("<frozen")
            ]
            self.attempts.append((name, stack))
        return None  # the usual finders decide


tensorflow_imports = TensorFlowImports()
sys.meta_path.insert(0, tensorflow_imports)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerastower as kt  # noqa: E402

assert keras.backend.backend() == "jax", f"run with KERAS_BACKEND=jax, not {keras.backend.backend()}"
import jax  # noqa: E402

assert len(jax.devices()) >= 2, f"2 towers need 2 JAX devices (XLA_FLAGS); got {jax.devices()}"

# The README's example, as it is but for the devices: on JAX the towers are
# jax.devices() (devices=None takes them all), made by XLA_FLAGS.
x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
y = (x.sum(axis=1) > 0).astype("int32")


@kt.distributed("mirrored", devices=None)   # or "single", "multihost"
def train():
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    model = kt.TowerModel(inputs, keras.layers.Dense(2)(h))
    model.compile(optimizer="adam",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)   # 16 per tower, 32 per step
    return model, model.evaluate(x, y, verbose=0, return_dict=True)


model, logs = train()
print(f"train_on_jax: {len(jax.devices())} JAX devices, evaluate: {logs}")
assert model.loop.global_step == 2 * 256 // (2 * 16), model.loop.global_step  # 2 epochs, 2 towers x 16
assert np.isfinite(logs["loss"]) and 0.0 <= logs["accuracy"] <= 1.0, logs

package = os.path.dirname(os.path.abspath(kt.__file__)) + os.sep
ours = [(name, stack) for name, stack in tensorflow_imports.attempts
        if any(frame.filename.startswith(package) for frame in stack)]
for name, stack in tensorflow_imports.attempts:
    where = "".join(traceback.format_list(stack[-6:]))
    print(f"train_on_jax: `import {name}` was tried from:\n{where}", file=sys.stderr)
assert not ours, f"kerastower tried to import TensorFlow on JAX {len(ours)} time(s): see above"
assert "tensorflow" not in sys.modules, "TensorFlow got imported on JAX"
print("train_on_jax: trained 2 towers on JAX; TensorFlow was never imported"
      + (f" (Keras itself tried {len(tensorflow_imports.attempts)} time(s), see above)"
         if tensorflow_imports.attempts else ", nor tried"))
