"""Trains one small model on shuffled arrays on 2 towers and prints its weights.

Run by tests/tensorflow/test_backend_switch.py once per backend (KERAS_BACKEND picks
it): the same seed must give the same run on TensorFlow and on JAX.
"""

import json
import sys

import keras
import numpy as np

import kerastower as kt


def main(epochs):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 2))).astype("float32") + rng.normal(size=(40, 2)).astype("float32")
    if keras.backend.backend() == "jax":
        import jax

        devices = jax.devices()[:2]
    else:
        import tensorflow as tf

        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        devices = ["/cpu:0", "/cpu:1"]
    with kt.distributed("mirrored", devices=devices):
        inputs = keras.Input((5,))
        outputs = keras.layers.Dense(2, kernel_initializer="zeros")(inputs)
        model = kt.TowerModel(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        np.random.seed(7)  # the shuffle's seed is drawn from numpy's generator
        history = model.fit(x, y, batch_size=3, epochs=epochs, shuffle=True, verbose=0)
    print(json.dumps({
        "weights": [np.asarray(w).tolist() for w in model.get_weights()],
        "loss": [float(v) for v in history.history["loss"]],
    }))


if __name__ == "__main__":
    main(int(sys.argv[1]))
