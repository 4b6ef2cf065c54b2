"""What Keras users call on a model, on both backends: a saved TowerModel
loads back compiled (no custom_objects), an uncompiled one predicts, and
the single-batch methods say what to use instead."""

import keras
import numpy as np
import pytest

import kerastower as kt

from shared_helpers import tower_devices


def _trained():
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    with kt.distributed("mirrored", devices=tower_devices(2)):
        inputs = keras.Input((4,))
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="adam", loss="mse", check_finite=False)
        model.fit(x, y, batch_size=4, verbose=0)
    return model, x, y


def test_a_saved_tower_model_loads_compiled_and_trains_on(tmp_path):
    model, x, y = _trained()
    model.save(tmp_path / "model.keras")
    with kt.distributed("mirrored", devices=tower_devices(2)):   # loaded onto 2 towers
        loaded = keras.models.load_model(tmp_path / "model.keras")   # no custom_objects
    assert isinstance(loaded, kt.TowerModel) and loaded.compiled
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) == 4
    assert loaded.tower_check_finite is False
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
    loaded.fit(x, y, batch_size=4, verbose=0)   # 32 examples, 2 towers x 4
    assert int(loaded.optimizer.iterations.numpy()) == 8 and loaded.num_towers == 2


def test_an_uncompiled_model_predicts():
    with kt.distributed("mirrored", devices=tower_devices(2)):
        inputs = keras.Input((4,))
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    x = np.random.default_rng(1).normal(size=(7, 4)).astype("float32")
    np.testing.assert_allclose(model.predict(x, batch_size=2, verbose=0), model(x), atol=1e-6)
