"""Callbacks, evaluate and the user read and write the weights each step
made, on both backends (on JAX the weights stay on the towers between
steps and reach the model's variables whenever something reads them)."""

import keras
import numpy as np

import kerastower as kt

from tests.helpers.common import tower_devices


def _model():
    with kt.distributed("mirrored", devices=tower_devices(2)):
        inputs = keras.Input((3,))
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _data(n=32):
    x = np.random.default_rng(0).normal(size=(n, 3)).astype("float32")
    return x, x @ np.array([[1.0], [-2.0], [0.5]], "float32")


def _sgd_step(kernel, bias, x, y, rate):
    """One SGD step of a Dense(1) on mse, by hand: the joined batch's update."""
    error = x @ kernel + bias - y
    return kernel - rate * 2 * x.T @ error / len(x), bias - rate * 2 * error.mean(axis=0)


class WeightsEachStep(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append([w.copy() for w in self.model.get_weights()])


def test_a_callback_reading_the_model_mid_epoch_sees_every_steps_weights():
    model = _model()
    x, y = _data()
    kernel, bias = (w.copy() for w in model.get_weights())
    reader = WeightsEachStep()
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[reader])
    assert len(reader.seen) == 4
    for step, (seen_kernel, seen_bias) in enumerate(reader.seen):
        joined = slice(8 * step, 8 * step + 8)
        kernel, bias = _sgd_step(kernel, bias, x[joined], y[joined], 0.1)
        np.testing.assert_allclose(seen_kernel, kernel, atol=1e-5)
        np.testing.assert_allclose(seen_bias, bias, atol=1e-5)
    np.testing.assert_allclose(model.get_weights()[0], kernel, atol=1e-5)


class LearningRateAt(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            self.model.optimizer.learning_rate.assign(0.0)


def test_a_callback_writing_a_variable_mid_epoch_takes_effect_at_the_next_step():
    model = _model()
    x, y = _data()
    kernel, bias = (w.copy() for w in model.get_weights())
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[LearningRateAt()])
    for step in range(2):  # then the learning rate is 0: the last two steps change nothing
        joined = slice(8 * step, 8 * step + 8)
        kernel, bias = _sgd_step(kernel, bias, x[joined], y[joined], 0.1)
    np.testing.assert_allclose(model.get_weights()[0], kernel, atol=1e-5)
    np.testing.assert_allclose(model.get_weights()[1], bias, atol=1e-5)
    assert int(model.optimizer.iterations.numpy()) == 4


def test_weights_set_by_the_user_between_calls_are_the_ones_used():
    model = _model()
    x, y = _data()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    zeros = [np.zeros_like(w) for w in model.get_weights()]
    model.set_weights(zeros)
    np.testing.assert_array_equal(model.predict(x, batch_size=4, verbose=0), np.zeros((32, 1)))
    assert model.evaluate(x, y, batch_size=4, verbose=0) == np.mean(y ** 2).astype("float32")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    kernel, bias = _sgd_step(zeros[0], zeros[1], x, y, 0.1)
    np.testing.assert_allclose(model.get_weights()[0], kernel, atol=1e-5)
