"""N towers x batch B equal one device on the concatenated N*B batch."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerastower as kt
from tests.tensorflow.helpers import TWO

B = 8


def _data(n=64, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype("float32")
    y = rng.integers(0, 3, n).astype("int32")
    return x, y


def _model(optimizer, weights=None, **compile_kwargs):
    inputs = keras.Input((5,))
    h = keras.layers.Dense(16, activation="tanh")(inputs)
    model = kt.TowerModel(inputs, keras.layers.Dense(3)(h))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **compile_kwargs,
    )
    if weights is not None:
        model.set_weights(weights)
    return model


def _train(strategy_name, devices, optimizer_fn, weights, x, y, batch, steps, **fit):
    with kt.distributed(strategy_name, devices=devices):
        model = _model(optimizer_fn(), weights)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
        model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, **fit)
        return model


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.5),
    "adam": lambda: keras.optimizers.Adam(0.05),
    "global_clipnorm": lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.05),
    "clipnorm": lambda: keras.optimizers.SGD(0.5, clipnorm=0.02),
    "clipvalue": lambda: keras.optimizers.SGD(0.5, clipvalue=0.001),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_two_towers_equal_one_device_on_the_joined_batch(name):
    x, y = _data()
    weights = _model("sgd").get_weights()
    two = _train("mirrored", TWO, OPTIMIZERS[name], weights, x, y, B, steps=1)
    one = _train("single", None, OPTIMIZERS[name], weights, x, y, 2 * B, steps=1)
    moved = max(np.abs(a - w).max() for a, w in zip(one.get_weights(), weights))
    assert moved > 1e-4, "the step must change the weights for the test to mean anything"
    for a, b in zip(one.get_weights(), two.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_clipping_acts_on_the_reduced_gradient_unlike_stock_keras():
    """Stock Keras clips each replica's share before summing them, so its
    update differs from one device's; kerastower's equals it (test above)."""
    x, y = _data()
    weights = _model("sgd").get_weights()
    opt = OPTIMIZERS["global_clipnorm"]
    one = _train("single", None, opt, weights, x, y, 2 * B, steps=1)
    mirrored = tf.distribute.MirroredStrategy(TWO, cross_device_ops=tf.distribute.ReductionToOneDevice())
    with mirrored.scope():
        inputs = keras.Input((5,))
        h = keras.layers.Dense(16, activation="tanh")(inputs)
        stock = keras.Model(inputs, keras.layers.Dense(3)(h))
        stock.compile(optimizer=opt(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        stock.set_weights(weights)
        stock.fit(x[: 2 * B], y[: 2 * B], batch_size=2 * B, epochs=1, shuffle=False, verbose=0)
    step_one = np.concatenate([(a - w).ravel() for a, w in zip(one.get_weights(), weights)])
    step_stock = np.concatenate([(a - w).ravel() for a, w in zip(stock.get_weights(), weights)])
    # One device clips the joined gradient to norm 0.05: the step is lr * 0.05.
    assert np.linalg.norm(step_one) == pytest.approx(0.5 * 0.05, rel=1e-4)
    assert np.linalg.norm(step_stock) > 1.2 * np.linalg.norm(step_one)


def test_steps_per_execution_gives_the_same_weights():
    x, y = _data(96)
    weights = _model("sgd").get_weights()

    def run(k):
        with kt.distributed("mirrored", devices=TWO):
            model = _model(keras.optimizers.Adam(0.02), weights, steps_per_execution=k)
            history = model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
            return model, history

    m1, h1 = run(1)
    m4, h4 = run(4)
    assert m1.optimizer.iterations.numpy() == m4.optimizer.iterations.numpy() == 12
    for a, b in zip(m1.get_weights(), m4.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(h1.history["loss"], h4.history["loss"], rtol=1e-6)


def test_steps_per_execution_stops_at_the_end_of_uneven_data():
    x, y = _data(40)  # 5 batches of 8 -> 3 steps on 2 towers, the last half empty
    with kt.distributed("mirrored", devices=TWO):
        model = _model(keras.optimizers.SGD(0.1), steps_per_execution=4)
        model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    assert model.optimizer.iterations.numpy() == 6


def test_uneven_last_step_equals_one_device():
    """40 examples, batch 8, 2 towers: the third step has tower 1 empty.
    Example weighting makes every step equal one device on the same examples."""
    x, y = _data(40)
    weights = _model("sgd").get_weights()
    two = _train("mirrored", TWO, OPTIMIZERS["sgd"], weights, x, y, B, steps=None)
    one = _train("single", None, OPTIMIZERS["sgd"], weights, x, y, 2 * B, steps=None)
    for a, b in zip(one.get_weights(), two.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_evaluate_and_predict_are_exact_and_in_order():
    x, y = _data(45)
    weights = _model("sgd").get_weights()
    with kt.distributed("mirrored", devices=TWO):
        two = _model("sgd", weights)
        ev2 = two.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)
        pr2 = two.predict(x, batch_size=4, verbose=0)
    one = _model("sgd", weights)
    ev1 = one.evaluate(x, y, batch_size=45, verbose=0, return_dict=True)
    pr1 = one.predict(x, batch_size=45, verbose=0)
    assert pr2.shape == (45, 3)
    np.testing.assert_allclose(pr1, pr2, atol=1e-6)
    for key in ("loss", "accuracy"):
        assert ev2[key] == pytest.approx(ev1[key], abs=1e-6)


def test_same_script_single_and_mirrored_reach_the_same_loss():
    x, y = _data(256, seed=7)
    w = np.random.default_rng(0).normal(size=(5, 1)).astype("float32")
    target = x @ w

    def script(strategy_name):
        @kt.distributed(strategy_name, devices=None if strategy_name == "single" else TWO)
        def train():
            keras.utils.set_random_seed(5)
            inputs = keras.Input((5,))
            model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            history = model.fit(x, target, batch_size=16, epochs=8, verbose=0)
            return history.history["loss"][-1]

        return train()

    single, mirrored = script("single"), script("mirrored")
    assert single < 1e-3 and mirrored < 1e-3
    assert abs(single - mirrored) < 1e-3


def test_run_eagerly_with_an_uneven_last_step_equals_graph_mode():
    x, y = _data(40)
    weights = _model("sgd").get_weights()

    def train(run_eagerly):
        with kt.distributed("mirrored", devices=TWO):
            model = _model(keras.optimizers.SGD(0.3), weights, run_eagerly=run_eagerly)
            model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
            return model

    for a, b in zip(train(True).get_weights(), train(False).get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_multi_output_evaluate_is_exact_and_per_output_losses_match_one_device():
    """The total loss and the per-output losses are one device's on the
    joined batch: 2 towers x 16 of 40 examples (steps of 32 and 8, the
    second on one tower) log the mean over the 40 examples. Keras's
    per-output trackers would count each tower's batch once (their static
    batch size is None): the mean of 16, 16 and 8 examples' losses."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype("float32")
    ya, yb = rng.normal(size=(40, 1)).astype("float32"), rng.normal(size=(40, 2)).astype("float32")

    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((4,))
        model = kt.TowerModel(inputs, {"a": keras.layers.Dense(1, name="a")(inputs),
                                       "b": keras.layers.Dense(2, name="b")(inputs)})
        model.compile(optimizer="sgd", loss={"a": "mse", "b": "mse"})
        return model

    y = {"a": ya, "b": yb}
    whole = build().evaluate(x, y, batch_size=40, verbose=0, return_dict=True)
    with kt.distributed("mirrored", devices=TWO):
        two = build().evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    assert set(whole) == set(two) and len(two) == 3
    for key in ("loss", "a_loss", "b_loss"):
        assert two[key] == pytest.approx(whole[key], rel=1e-5), key
