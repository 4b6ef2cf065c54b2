"""`kt.TowerSequential`: a keras.Sequential that trains with towers."""

import keras
import numpy as np

import kerastower as kt

from tests.helpers.common import tower_devices


def _layers():
    return [keras.layers.Dense(8, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(seed=1)),
            keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2))]


def test_two_towers_equal_one_device_sequential_on_the_joined_batch_and_it_saves(tmp_path):
    x = np.random.default_rng(0).normal(size=(48, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    stock = keras.Sequential(_layers())
    stock.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    want = stock.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    with kt.distributed("mirrored", devices=tower_devices(2)):
        model = kt.TowerSequential()   # built as Keras users build one: add, then a deferred build
        for layer in _layers():
            model.add(layer)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        got = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    for a, b in zip(model.get_weights(), stock.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    model.save(tmp_path / "sequential.keras")
    with kt.distributed("mirrored", devices=tower_devices(2)):
        loaded = keras.models.load_model(tmp_path / "sequential.keras")
    assert type(loaded) is kt.TowerSequential and loaded.num_towers == 2
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
