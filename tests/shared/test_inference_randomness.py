"""Randomness at inference carries on from call to call, as in stock Keras.

A layer that draws from a `keras.random.SeedGenerator` in `call` (test-time
dropout, Monte Carlo dropout) moves the generator's state in every
evaluation and prediction step; stock Keras keeps the moved state, so two
`predict` calls draw different masks and a later `fit` starts from the
moved state. On JAX the step is stateless: kerastower's evaluation and
prediction steps hand the changed state back (`TowerSteps._changed`), and
the towers keep it. A model never built is built by predict from its first
batch, as stock Keras-JAX builds it.
"""

import keras
import numpy as np
import pytest

from tests.helpers.common import tower_devices

import kerastower as kt


class DropoutAtInference(keras.layers.Layer):
    """Dropout that also drops at inference (its own seed generator)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = keras.random.SeedGenerator(3)

    def call(self, x):
        return keras.random.dropout(x, rate=0.5, seed=self.generator)


X = np.random.default_rng(0).normal(size=(8, 6)).astype("float32")
Y = np.ones((8, 4), "float32")


def _model(base):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(4)(inputs))
    model = base(inputs, DropoutAtInference()(hidden))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _calls(model):
    """Two predictions, two evaluations, a fit, a prediction: what each
    gave, and the generator's state at the end."""
    got = [model.predict(X, batch_size=4, verbose=0) for _ in range(2)]
    got += [np.asarray(model.evaluate(X, Y, batch_size=4, verbose=0)) for _ in range(2)]
    model.fit(X, Y, batch_size=4, verbose=0)
    got.append(model.predict(X, batch_size=4, verbose=0))
    return got, np.asarray(model.layers[-1].generator.state.value)


def test_one_tower_draws_what_stock_keras_draws():
    want, want_state = _calls(_model(keras.Model))
    got, got_state = _calls(_model(kt.TowerModel))
    assert not np.array_equal(want[0], want[1])   # the premise: stock draws anew
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(got_state, want_state)


def test_towers_draw_anew_every_call():
    with kt.distributed("mirrored", devices=tower_devices(2)):
        model = _model(kt.TowerModel)
    first = model.predict(X, batch_size=4, verbose=0)
    second = model.predict(X, batch_size=4, verbose=0)
    assert not np.array_equal(first, second)


@pytest.mark.parametrize("inputs", ["tuple", "dict"])
def test_predict_builds_a_subclassed_model_never_called(inputs):
    class Sum(kt.TowerModel):
        def call(self, data):
            a, b = (data["a"], data["b"]) if isinstance(data, dict) else data
            return a + b

    a, b = np.random.default_rng(1).random((2, 3, 4)).astype("float32")
    out = Sum().predict({"a": a, "b": b} if inputs == "dict" else (a, b), verbose=0)
    np.testing.assert_allclose(out, a + b, rtol=1e-6)
