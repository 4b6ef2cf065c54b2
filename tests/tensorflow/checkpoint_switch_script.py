"""Trains one small deterministic model on 2 towers with AutoResume and
ModelSaver, phase after phase; prints what each phase ended with.

    KERAS_BACKEND=jax|tensorflow python checkpoint_switch_script.py PHASES [--refuse-tensorflow]

PHASES is a JSON list of [epochs, checkpoint directory or null]: each
phase builds the model afresh and fits it for that many epochs on the same
shuffled arrays, with AutoResume and ModelSaver on the directory (with
null, neither). The last stdout line is a JSON list, per phase: the
weights, the optimizer's iterations, the checkpoint restored from, the
epochs that began, the dtype of each integer variable, and the random
stream's state.
--refuse-tensorflow makes importing TensorFlow fail (a JAX-only install).

Run by tests/tensorflow/test_backend_switch.py on both backends: a checkpoint written
on one must resume on the other.
"""

import json
import os
import sys
import warnings


class RefuseTensorFlow:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "tensorflow":
            raise ImportError(f"this run forbids importing {name}")


# --keras-seed: keras.utils.set_random_seed before each fit, not numpy's seed.
KERAS_SEED = "--keras-seed" in sys.argv

if "--refuse-tensorflow" in sys.argv:
    sys.meta_path.insert(0, RefuseTensorFlow())

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerastower as kt  # noqa: E402
from kerastower.checkpoint.keys import keyed_variables  # noqa: E402


class Jitter(keras.layers.Layer):
    """Draws from its own random stream at every training step and adds
    nothing to its input: a seed-generator state that the checkpoint carries
    (int64 on TensorFlow, uint32 on JAX), in a model that stays deterministic."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(3)

    def call(self, x, training=False):
        if training:
            return x + 0.0 * keras.random.uniform(keras.ops.shape(x), seed=self.seed_generator)
        return x


class EpochsBegun(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)


def devices():
    if keras.backend.backend() == "jax":
        import jax

        return jax.devices()[:2]
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    return ["/cpu:0", "/cpu:1"]


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5)).astype("float32")
    y = np.tanh(x @ rng.normal(size=(5, 2))).astype("float32")
    return x, y


def phase(towers, epochs, ckpt_dir):
    x, y = data()
    with kt.distributed("mirrored", devices=towers):
        inputs = keras.Input((5,))
        h = keras.layers.Dense(6, activation="tanh", name="hidden")(inputs)
        h = Jitter(name="jitter")(h)
        model = kt.TowerModel(inputs, keras.layers.Dense(2, name="out")(h))
        # The same starting weights on both backends (their initializers differ).
        start = np.random.default_rng(1)
        model.set_weights([start.normal(scale=0.5, size=w.shape).astype("float32")
                           for w in model.get_weights()])
        model.compile(optimizer=keras.optimizers.Adam(0.02), loss="mse")
        begun = EpochsBegun()
        resume = kt.callbacks.AutoResume(ckpt_dir) if ckpt_dir else None
        saver = kt.callbacks.ModelSaver(ckpt_dir) if ckpt_dir else None
        callbacks = [c for c in (resume, saver, begun) if c is not None]
        if KERAS_SEED:  # stock Keras's order on this backend (inputs/keras_order.py)
            keras.utils.set_random_seed(7)
        else:
            np.random.seed(7)  # the shuffle's seed is drawn from numpy's generator
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=4, epochs=epochs, shuffle=True, verbose=0, callbacks=callbacks)
    integers = {key: str(np.dtype(keras.backend.standardize_dtype(v.dtype)))
                for key, _, v in keyed_variables(model)
                if keras.backend.standardize_dtype(v.dtype).startswith(("int", "uint"))}
    return {
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
        "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        "global_step": model.loop.global_step,
        "restored_from": resume and resume.restored_from and os.path.basename(resume.restored_from),
        "epochs_begun": begun.epochs,
        "warnings": [str(w.message) for w in caught if "kerastower" in str(w.message)],
        "integer_dtypes": integers,
        "seed_state": keras.ops.convert_to_numpy(
            model.get_layer("jitter").seed_generator.state.value).tolist(),
    }


def main(phases):
    towers = devices()
    results = [phase(towers, epochs, ckpt_dir) for epochs, ckpt_dir in phases]
    for result in results:
        result["tensorflow_imported"] = "tensorflow" in sys.modules
    print(json.dumps(results))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
