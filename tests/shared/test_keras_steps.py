"""What Keras's fit does with a model's step, kerastower does on both
backends: a model without trainable weights trains on with Keras's warning,
and values a custom step returns reach the logs."""

import warnings

import keras
import numpy as np
import pytest

from tests.helpers.common import tower_devices

import kerastower as kt


def _data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


def _frozen(make_model):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    model = make_model(inputs, keras.layers.Dense(2, trainable=False)(inputs))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


def _fit_warned(model, x, y, batch_size):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return history.history, [str(w.message) for w in caught]


def test_a_model_without_trainable_weights_trains_on_with_keras_warning():
    x, y = _data()
    stock = _frozen(keras.Model)
    want, stock_warnings = _fit_warned(stock, x, y, 16)
    for towers, batch_size in ((1, 16), (2, 8)):
        with kt.distributed("mirrored", devices=tower_devices(towers)):
            model = _frozen(kt.TowerModel)
        start = model.get_weights()
        got, tower_warnings = _fit_warned(model, x, y, batch_size)
        # Keras warns on TensorFlow (not on JAX, whose step has no such check).
        warning = "The model does not have any trainable weights."
        assert (warning in tower_warnings) == (warning in stock_warnings)
        assert int(model.optimizer.iterations.numpy()) == int(stock.optimizer.iterations.numpy()) == 0
        assert model.loop.global_step == 4
        for a, b in zip(model.get_weights(), start):
            np.testing.assert_array_equal(a, b)
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], atol=1e-5, err_msg=f"{towers}: {key}")


def _hand_written_steps(base, returned, test_key):
    """A subclass of `base` whose train_step computes a mean squared error
    by hand and returns `returned(model, loss, y, predicted)` (its metrics
    updated inside it on JAX too), and whose test_step returns that error
    under `test_key`: Keras's custom-fit pattern, on either backend."""
    from tests.helpers.common import BACKEND

    class Model(base):
        if BACKEND == "tensorflow":
            def train_step(self, data):
                import tensorflow as tf

                x, y = data
                with tf.GradientTape() as tape:
                    predicted = self(x, training=True)
                    loss = keras.ops.mean((predicted - y) ** 2)
                gradients = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply(gradients, self.trainable_variables)
                return returned(self, loss, y, predicted)

            def test_step(self, data):
                x, y = data
                predicted = self(x, training=False)
                return {test_key: keras.ops.mean((predicted - y) ** 2)}
        else:
            def train_step(self, state, data):
                import jax

                trainable, non_trainable, optimizer_vars, metrics = state
                x, y = data

                def loss_fn(trainable):
                    predicted, updated = self.stateless_call(trainable, non_trainable, x, training=True)
                    return keras.ops.mean((predicted - y) ** 2), (predicted, updated)

                (loss, (predicted, non_trainable)), grads = jax.value_and_grad(
                    loss_fn, has_aux=True)(trainable)
                trainable, optimizer_vars = self.optimizer.stateless_apply(optimizer_vars, grads, trainable)
                with keras.StatelessScope(
                        state_mapping=list(zip(self.metrics_variables, metrics))) as scope:
                    logs = returned(self, loss, y, predicted)
                metrics = [scope.get_current_value(v) for v in self.metrics_variables]
                return logs, (trainable, non_trainable, optimizer_vars, metrics)

            def test_step(self, state, data):
                trainable, non_trainable, metrics = state
                x, y = data
                predicted, _ = self.stateless_call(trainable, non_trainable, x, training=False)
                return {test_key: keras.ops.mean((predicted - y) ** 2)}, state

    return Model


def _returning_values(base):
    """keras.io's pattern (WGAN-GP's `{"d_loss": ..., "g_loss": ...}`): a
    train_step that returns values it computed, not metrics."""
    Model = _hand_written_steps(
        base, lambda model, loss, y, predicted: {"my_loss": loss, "mean_output": keras.ops.mean(predicted)},
        "my_loss")

    keras.utils.set_random_seed(4)
    inputs = keras.Input((4,))
    model = Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(6, activation="tanh")(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


def test_values_a_custom_train_step_returns_are_logged_as_keras_logs_them():
    x, y = _data(48)
    stock = _returning_values(keras.Model)
    want = stock.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0).history
    want_evaluated = stock.evaluate(x, y, batch_size=16, return_dict=True, verbose=0)
    assert sorted(want) == ["mean_output", "my_loss"]
    for towers in (1, 2, 4):
        with kt.distributed("mirrored", devices=tower_devices(towers)):
            model = _returning_values(kt.TowerModel)
        got = model.fit(x, y, batch_size=16 // towers, epochs=3, shuffle=False, verbose=0).history
        # No key nothing computed (no "loss" of 0.0 from the unused tracker).
        assert sorted(got) == sorted(want), towers
        # The mean over the towers' equal shares is the joined batch's mean.
        for key in want:
            np.testing.assert_allclose(got[key], want[key], atol=1e-5, err_msg=f"{towers}: {key}")
        # evaluate logs the last step's values, as Keras logs the last batch's.
        evaluated = model.evaluate(x, y, batch_size=16 // towers, return_dict=True, verbose=0)
        assert sorted(evaluated) == ["my_loss"], towers
        np.testing.assert_allclose(evaluated["my_loss"], want_evaluated["my_loss"], atol=1e-5)


def _recording(base, seen):
    """An autoencoder whose train_step notes how its data is packed."""
    from tests.helpers.common import BACKEND

    def note(data):
        seen.append(type(data).__name__ if not isinstance(data, tuple)
                    else f"tuple of {len(data)}")

    class AutoEncoder(base):
        if BACKEND == "tensorflow":
            def train_step(self, data):
                note(data)
                return super().train_step(data)
        else:
            def train_step(self, state, data):
                note(data)
                return super().train_step(state, data)

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            return keras.ops.mean((y_pred - x) ** 2)

    keras.utils.set_random_seed(2)
    inputs = keras.Input((4,))
    model = AutoEncoder(inputs, keras.layers.Dense(4)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


def test_the_step_gets_x_alone_without_y_as_keras_packs_it():
    """keras.io's VAE calls its encoder on `data`: fit(x) must hand over x,
    not (x,) (issue 31, item 3)."""
    x, _ = _data()

    def batches():
        for start in range(0, 32, 8):
            yield x[start:start + 8]

    stock_seen, tower_seen = [], []
    stock = _recording(keras.Model, stock_seen)
    want = stock.fit(x, batch_size=8, shuffle=False, verbose=0).history["loss"]
    for towers, batch_size in ((1, 8), (2, 4)):
        with kt.distributed("mirrored", devices=tower_devices(towers)):
            model = _recording(kt.TowerModel, tower_seen)
        got = model.fit(x, batch_size=batch_size, shuffle=False, verbose=0).history["loss"]
        np.testing.assert_allclose(got, want, atol=1e-5)
        tower_seen.clear()
        with kt.distributed("mirrored", devices=tower_devices(towers)):
            model = _recording(kt.TowerModel, tower_seen)
        model.fit(batches(), verbose=0)
        assert tower_seen and set(tower_seen) <= set(stock_seen), (towers, tower_seen, stock_seen)
    assert "tuple of 1" not in stock_seen



def _loss_by_hand(base, returned_keys):
    """A model compiled with a loss (and "rmse" where `returned_keys` holds
    it) whose train_step computes its loss by hand, never updating the
    compiled loss tracker, and returns `returned_keys` of: "loss", that
    loss; "rmse", the compiled rmse's result, which it does update;
    "mean_output", a value naming no metric (issue 26). Its test_step
    returns `{"loss": loss}`."""

    def returned(model, loss, y, predicted):
        logs = {"loss": loss, "mean_output": keras.ops.mean(predicted)}
        if "rmse" in returned_keys:
            for metric in model.metrics:
                if metric.name != "loss":
                    metric.update_state(y, predicted)
            logs["rmse"] = model.get_metrics_result()["rmse"]
        return {key: logs[key] for key in returned_keys}

    Model = _hand_written_steps(base, returned, "loss")

    keras.utils.set_random_seed(5)
    inputs = keras.Input((4,))
    model = Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(6, activation="tanh")(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                  metrics=[keras.metrics.RootMeanSquaredError(name="rmse")]
                  if "rmse" in returned_keys else None)
    return model


class _BatchLogs(keras.callbacks.Callback):
    """The logs batch callbacks get, in fit and in evaluate."""

    def __init__(self):
        super().__init__()
        self.train, self.test = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.train.append(dict(logs))

    def on_test_batch_end(self, batch, logs=None):
        self.test.append(dict(logs))

    def assert_close(self, want, towers):
        for got_logs, want_logs, phase in ((self.train, want.train, "train"),
                                           (self.test, want.test, "test")):
            assert len(got_logs) == len(want_logs), (towers, phase)
            for step, (got, expected) in enumerate(zip(got_logs, want_logs)):
                assert sorted(got) == sorted(expected), (towers, phase, step)
                for key in expected:
                    np.testing.assert_allclose(
                        got[key], expected[key], atol=1e-5,
                        err_msg=f"{towers} towers, {phase} batch {step}: {key}")


@pytest.mark.parametrize("returned_keys", [
    ("loss",), ("loss", "mean_output"), ("loss", "rmse"), ("loss", "rmse", "mean_output"),
], ids="+".join)
@pytest.mark.parametrize("examples", [48, 40], ids=["equal_towers", "short_last_step"])
def test_a_raw_value_under_a_metrics_key_is_logged_as_keras_logs_it(returned_keys, examples):
    """A custom step returning `{"loss": loss}` computed by hand (issue 26).

    Keras's fit and evaluate log the metrics' results when the step
    returned exactly their keys (then the loss tracker nothing updated:
    0.0), and what it returned otherwise: the raw loss, and the metrics'
    results it returned under their keys. kerastower logs the same, a raw
    value as the towers' mean, a returned metric result as the metric read
    across towers. A root mean squared error is not the mean of the
    towers' own, so a returned metric result read as a raw value shows; so
    it does on TensorFlow with 40 examples, whose last step of one batch of
    8 runs on tower 0 alone, with its own running rmse."""
    x, y = _data(examples, seed=6)
    stock = _loss_by_hand(keras.Model, returned_keys)
    want_batches = _BatchLogs()
    want = stock.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                     callbacks=[want_batches]).history
    want_evaluated = stock.evaluate(x, y, batch_size=16, return_dict=True, verbose=0,
                                    callbacks=[want_batches])
    assert sorted(want) == sorted(returned_keys)
    # Keras's own rule, which this test holds kerastower to.
    metric_keys = {"loss", "rmse"} & set(returned_keys) | {"loss"}
    assert (want["loss"] == [0.0] * 3) == (set(returned_keys) == metric_keys)
    assert (want_evaluated["loss"] == 0.0) == ("rmse" not in returned_keys)
    for towers in (1, 2):
        with kt.distributed("mirrored", devices=tower_devices(towers)):
            model = _loss_by_hand(kt.TowerModel, returned_keys)
        got_batches = _BatchLogs()
        got = model.fit(x, y, batch_size=16 // towers, epochs=3, shuffle=False, verbose=0,
                        callbacks=[got_batches]).history
        assert sorted(got) == sorted(want), towers
        for key in want:
            np.testing.assert_allclose(got[key], want[key], atol=1e-5, err_msg=f"{towers}: {key}")
        evaluated = model.evaluate(x, y, batch_size=16 // towers, return_dict=True, verbose=0,
                                   callbacks=[got_batches])
        # Batch callbacks get what the step returned, as Keras hands it to them.
        got_batches.assert_close(want_batches, towers)
        assert sorted(evaluated) == sorted(want_evaluated), towers
        np.testing.assert_allclose(evaluated["loss"], want_evaluated["loss"], atol=1e-5,
                                   err_msg=str(towers))
