"""What Keras users call on a model, on both backends: a saved TowerModel
loads back compiled (no custom_objects), an uncompiled one predicts, and
the single-batch methods say what to use instead."""

import contextlib
import keras
import numpy as np
import pytest

import kerastower as kt

from tests.helpers.common import tower_devices


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


@pytest.mark.parametrize("num_towers", [1, 2])
def test_an_optimizer_accumulating_gradients_trains_as_in_keras(num_towers):
    # With `gradient_accumulation_steps`, Keras's JAX optimizer holds its
    # step count as an array, not a variable: fit reads it either way.
    # Two towers of 4 examples each are one Keras batch of 8.
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def trained(model_class, batch_size, devices):
        # Stock Keras on TensorFlow cannot accumulate under MirroredStrategy
        # (a merge_call in its tf.cond): its reference is trained without one.
        stock_tf = model_class is keras.Model and keras.backend.backend() == "tensorflow"
        with contextlib.nullcontext() if stock_tf else kt.distributed("mirrored", devices=devices):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((8,))
            model = model_class(inputs, keras.layers.Dense(1)(inputs))
            model.compile(optimizer=keras.optimizers.SGD(0.05, gradient_accumulation_steps=2), loss="mse")
            history = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
        return model, history.history["loss"]

    # On TensorFlow too: kerastower takes Keras's accumulate-or-apply choice
    # where MirroredStrategy can update (tests/shared/test_gradient_accumulation.py).
    reference, reference_losses = trained(keras.Model, 8, tower_devices(1))
    model, losses = trained(kt.TowerModel, 8 // num_towers, tower_devices(num_towers))
    # Keras counts the updates applied, one each 2 steps.
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == int(
        keras.ops.convert_to_numpy(reference.optimizer.iterations)) == 4
    assert model.loop.global_step == 8
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
