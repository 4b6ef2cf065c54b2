"""The JAX forms of keras.io's custom-fit programs, base class changed only (issue 31).

keras.io's "Customizing what happens in fit() with JAX" writes the step as
a pure function of the state: `train_step(self, state, data)` returning
`(logs, state)`, with `compute_loss_and_updates` under
`jax.value_and_grad`, metrics updated with `stateless_update_state`, and
its own `test_step(self, state, data)`. Each program here runs from the same
seed as written (`keras.Model`, stock Keras-JAX), with `kt.TowerModel` on
one tower (the same logs within 1e-6, the same weights) and on two towers
at half the batch (the same as one tower on the joined batches, 1e-5).

The arrays are shuffled (Keras's default) from the test's seed: with
`keras.utils.set_random_seed`, one tower reads them in stock Keras-JAX's
order, and two towers read the joined batches in it.
"""

import jax
import keras
import numpy as np
import pytest

import kerastower as kt
from tests.helpers.common import assert_logs_equal

BATCH = 8
RNG = np.random.default_rng(0)
X = RNG.normal(size=(48, 6)).astype("float32")
Y = (X @ RNG.normal(size=(6, 1))).astype("float32")


def _stateless_metrics(model, metrics_variables, loss, y, y_pred):
    """keras.io's loop over the metrics: the loss tracker takes the loss,
    the others (y, y_pred); returns (logs, new metrics variables)."""
    new_metrics_vars, logs = [], {}
    for metric in model.metrics:
        this_metric_vars = metrics_variables[len(new_metrics_vars):len(new_metrics_vars) + len(metric.variables)]
        if metric.name == "loss":
            this_metric_vars = metric.stateless_update_state(this_metric_vars, loss)
        else:
            this_metric_vars = metric.stateless_update_state(this_metric_vars, y, y_pred)
        logs[metric.name] = metric.stateless_result(this_metric_vars)
        new_metrics_vars += this_metric_vars
    return logs, new_metrics_vars


def program_first_simple_example(base):
    class CustomModel(base):
        def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y,
                                     training=False):
            y_pred, non_trainable_variables = self.stateless_call(
                trainable_variables, non_trainable_variables, x, training=training)
            loss = self.compute_loss(x, y, y_pred)
            return loss, (y_pred, non_trainable_variables)

        def train_step(self, state, data):
            trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
            x, y = data
            grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
            (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
                trainable_variables, non_trainable_variables, x, y, training=True)
            trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable_variables)
            logs, new_metrics_vars = _stateless_metrics(self, metrics_variables, loss, y, y_pred)
            return logs, (trainable_variables, non_trainable_variables, optimizer_variables, new_metrics_vars)

    inputs = keras.Input(shape=(6,))
    model = CustomModel(inputs, keras.layers.Dense(1)(keras.layers.Dense(4, activation="tanh")(inputs)))
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model, (X, Y)


def program_going_lower_level(base):
    class CustomModel(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
            self.loss_fn = keras.losses.MeanSquaredError()

        def compute_loss_and_updates(self, trainable_variables, non_trainable_variables, x, y,
                                     training=False):
            y_pred, non_trainable_variables = self.stateless_call(
                trainable_variables, non_trainable_variables, x, training=training)
            return self.loss_fn(y, y_pred), (y_pred, non_trainable_variables)

        def train_step(self, state, data):
            trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
            x, y = data
            grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)
            (loss, (y_pred, non_trainable_variables)), grads = grad_fn(
                trainable_variables, non_trainable_variables, x, y, training=True)
            trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable_variables)
            loss_tracker_vars = metrics_variables[:len(self.loss_tracker.variables)]
            mae_metric_vars = metrics_variables[len(self.loss_tracker.variables):]
            loss_tracker_vars = self.loss_tracker.stateless_update_state(loss_tracker_vars, loss)
            mae_metric_vars = self.mae_metric.stateless_update_state(mae_metric_vars, y, y_pred)
            logs = {self.loss_tracker.name: self.loss_tracker.stateless_result(loss_tracker_vars),
                    self.mae_metric.name: self.mae_metric.stateless_result(mae_metric_vars)}
            new_metrics_vars = loss_tracker_vars + mae_metric_vars
            return logs, (trainable_variables, non_trainable_variables, optimizer_variables, new_metrics_vars)

        @property
        def metrics(self):
            return [self.loss_tracker, self.mae_metric]

    inputs = keras.Input(shape=(6,))
    model = CustomModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="adam")
    return model, (X, Y)


def program_own_evaluation_step(base):
    class CustomModel(base):
        def test_step(self, state, data):
            x, y = data
            trainable_variables, non_trainable_variables, metrics_variables = state
            y_pred, non_trainable_variables = self.stateless_call(
                trainable_variables, non_trainable_variables, x, training=False)
            loss = self.compute_loss(x, y, y_pred)
            logs, new_metrics_vars = _stateless_metrics(self, metrics_variables, loss, y, y_pred)
            return logs, (trainable_variables, non_trainable_variables, new_metrics_vars)

    inputs = keras.Input(shape=(6,))
    model = CustomModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="adam", loss="mae", metrics=["mae"])
    return model, (X, Y)


def program_autoencoder_without_call(base):
    """A model without call() over two built parts, trained with fit(x):
    the step gets x alone and calls each part statelessly on its share of
    the state (the JAX form of keras.io's VAE)."""
    encoder = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3, activation="tanh")], name="encoder")
    decoder = keras.Sequential([keras.Input((3,)), keras.layers.Dense(6)], name="decoder")

    class AutoEncoder(base):
        def __init__(self, encoder, decoder):
            super().__init__()
            self.encoder = encoder
            self.decoder = decoder
            self.loss_tracker = keras.metrics.Mean(name="loss")

        @property
        def metrics(self):
            return [self.loss_tracker]

        def reconstruction_loss(self, trainable_variables, non_trainable_variables, x):
            cut = len(self.encoder.trainable_variables)
            z, _ = self.encoder.stateless_call(trainable_variables[:cut], [], x)
            reconstruction, _ = self.decoder.stateless_call(trainable_variables[cut:], [], z)
            return keras.ops.mean(keras.ops.square(reconstruction - x))

        def train_step(self, state, data):
            # fit(x) without y: the step gets x alone, as Keras packs it.
            assert not isinstance(data, (tuple, list)), f"the step got {type(data).__name__}, not x"
            trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables = state
            loss, grads = jax.value_and_grad(self.reconstruction_loss)(
                trainable_variables, non_trainable_variables, data)
            trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
                optimizer_variables, grads, trainable_variables)
            metrics_variables = self.loss_tracker.stateless_update_state(metrics_variables, loss)
            logs = {"loss": self.loss_tracker.stateless_result(metrics_variables)}
            return logs, (trainable_variables, non_trainable_variables, optimizer_variables, metrics_variables)

    model = AutoEncoder(encoder, decoder)
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    if base is keras.Model:
        # Stock Keras-JAX runs call() on a symbolic batch to build any model:
        # without call() its user must say it is built. kerastower sees that
        # its parts are.
        model.built = True
    return model, (X,)


PROGRAMS = {name[len("program_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("program_")}


def _run(program, base, strategy=None, devices=None, batch_size=BATCH):
    keras.utils.set_random_seed(0)

    def train():
        model, data = program(base)
        history = model.fit(*data, batch_size=batch_size, epochs=2, verbose=0)
        # keras.io's programs that change compute_loss_and_updates's
        # signature cannot run Keras's own test_step: only the one with its
        # own evaluation step evaluates.
        evaluated = (model.evaluate(*data, batch_size=batch_size, verbose=0, return_dict=True)
                     if type(model).test_step is not base.test_step else {})
        return model, history.history, evaluated

    if strategy is None:
        model, logs, evaluated = train()
    else:
        with kt.distributed(strategy, devices=devices):
            model, logs, evaluated = train()
    return model, logs, [np.asarray(w.numpy()) for w in model.weights], evaluated




@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_jax_keras_io_program_with_its_base_class_changed(name):
    program = PROGRAMS[name]
    stock, stock_logs, stock_weights, stock_eval = _run(program, keras.Model)
    one, one_logs, one_weights, one_eval = _run(program, kt.TowerModel, "single")
    assert isinstance(one, kt.TowerModel) and not isinstance(stock, kt.TowerModel)
    assert_logs_equal(one_logs, stock_logs, 1e-6, f"{name}, 1 tower against stock Keras-JAX")
    assert_logs_equal(one_eval, stock_eval, 1e-6, f"{name}, evaluate, 1 tower against stock")
    for got, want in zip(one_weights, stock_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    devices = jax.devices()[:2]
    two, two_logs, two_weights, two_eval = _run(program, kt.TowerModel, "mirrored", devices, BATCH // 2)
    assert_logs_equal(two_logs, one_logs, 1e-5, f"{name}, 2 towers against 1")
    assert_logs_equal(two_eval, one_eval, 1e-5, f"{name}, evaluate, 2 towers against 1")
    for got, want in zip(two_weights, one_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("shuffle", [True, "batch"])
def test_seeded_shuffle_and_validation_split_give_stock_keras_jax_numbers(shuffle):
    """With `keras.utils.set_random_seed`, `fit(x, y)` on JAX reads the
    arrays in stock Keras-JAX's order (numpy's generator, drawn per epoch
    and once for the build), splits off the same validation rows, and
    leaves numpy's generator where stock Keras does; two towers at half
    the batch read the joined batches in that order. Two fits in a row
    check that the second starts from the generator the first left."""

    def run(base, strategy=None, devices=None, batch_size=8):
        keras.utils.set_random_seed(0)

        def train():
            inputs = keras.Input((6,))
            model = base(inputs, keras.layers.Dense(1)(keras.layers.Dense(4, activation="tanh")(inputs)))
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
            logs = []
            for _ in range(2):
                logs.append(model.fit(X, Y, batch_size=batch_size, epochs=2, shuffle=shuffle,
                                      validation_split=0.25, verbose=0).history)
            return logs, [np.asarray(w.numpy()) for w in model.weights], np.random.randint(2**31)

        if strategy is None:
            return train()
        with kt.distributed(strategy, devices=devices):
            return train()

    stock_logs, stock_weights, stock_next = run(keras.Model)
    one_logs, one_weights, one_next = run(kt.TowerModel, "single")
    for got, want in zip(one_logs, stock_logs):
        assert_logs_equal(got, want, 1e-6, f"shuffle={shuffle!r}, 1 tower against stock Keras-JAX")
    for got, want in zip(one_weights, stock_weights):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert one_next == stock_next, "numpy's generator is not where stock Keras leaves it"
    two_logs, two_weights, _ = run(kt.TowerModel, "mirrored", jax.devices()[:2], batch_size=4)
    for got, want in zip(two_logs, one_logs):
        assert_logs_equal(got, want, 1e-5, f"shuffle={shuffle!r}, 2 towers against 1")
    for got, want in zip(two_weights, one_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
