"""N towers on JAX train exactly like one device on the joined batch.

Each case builds the same model twice (same initial weights), trains it on
one device with batch N x B and on N towers with batch B over the same
arrays (tower k takes the k-th next batch), and compares the weights and
every logged value, as tests/test_equivalence_matrix.py does on TensorFlow.
"""

import jax
import keras
import numpy as np
import pytest
from keras import ops

import kerastower as kt

B = 8
STEPS = 3
SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.3),
    "adam": lambda: keras.optimizers.Adam(0.03),
    "clipnorm": lambda: keras.optimizers.SGD(0.3, clipnorm=0.05),
}


def _features(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n).astype("int32")


def dense(optimizer):
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    model = kt.TowerModel(inputs, keras.layers.Dense(3)(h))
    model.compile(optimizer=optimizer, loss=SCCE, metrics=["accuracy"])
    return model


def dense_data(n):
    x, y = _features(n)
    return {"x": x, "y": y}


def weighted_data(n):
    x, y = _features(n, seed=4)
    weights = np.random.default_rng(5).uniform(0.1, 2.0, n).astype("float32")
    return {"x": x, "y": y, "sample_weight": weights}


def embedding(optimizer):
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(12, 4)(inputs))
    model = kt.TowerModel(inputs, keras.layers.Dense(3)(h))
    model.compile(optimizer=optimizer, loss=SCCE, metrics=["accuracy"])
    return model


def embedding_data(n):
    rng = np.random.default_rng(1)
    return {"x": rng.integers(0, 12, (n, 5)).astype("int32"), "y": rng.integers(0, 3, n).astype("int32")}


def multi_output(optimizer):
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = {"a": keras.layers.Dense(1, name="a")(h), "b": keras.layers.Dense(3, name="b")(h)}
    model = kt.TowerModel(inputs, outputs)
    model.compile(optimizer=optimizer, loss={"a": "mse", "b": SCCE}, loss_weights={"a": 0.3, "b": 1.0},
                  metrics={"b": ["accuracy"]})
    return model


def multi_output_data(n):
    x, y = _features(n, seed=2)
    return {"x": x, "y": {"a": x[:, :1] * 2.0, "b": y}}


class ComputeLossModel(kt.TowerModel):
    """compute_loss overridden the keras.io way, with its own tracker."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def call(self, x):
        return self.out(self.hidden(x))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = ops.mean((y_pred - y) ** 2)
        self.loss_tracker.update_state(loss)
        return loss

    @property
    def metrics(self):
        return [self.loss_tracker]


def compute_loss(optimizer):
    model = ComputeLossModel()
    model.compile(optimizer=optimizer)
    return model


def regression_data(n):
    x, _ = _features(n, seed=3)
    return {"x": x, "y": np.tanh(x[:, :1] - x[:, 1:2]).astype("float32")}


CASES = {
    "dense": (dense, dense_data),
    "sample_weight": (dense, weighted_data),
    "embedding": (embedding, embedding_data),
    "multi_output": (multi_output, multi_output_data),
    "compute_loss": (compute_loss, regression_data),
}


def _fit(case, optimizer_name, batch_size, towers, initial=None):
    build, data = CASES[case]
    with kt.distributed("mirrored", devices=list(range(towers))):
        keras.utils.set_random_seed(7)
        model = build(OPTIMIZERS[optimizer_name]())
        arrays = data(B * 4 * STEPS)
        model(arrays["x"][:1])
        if initial is None:
            initial = [np.array(w) for w in model.get_weights()]
        model.set_weights(initial)
        history = model.fit(**arrays, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return model, history.history, initial


@pytest.mark.parametrize("towers", [2, 4])
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_towers_equal_one_device(case, optimizer_name, towers):
    one, one_logs, initial = _fit(case, optimizer_name, towers * B, 1)
    many, many_logs, _ = _fit(case, optimizer_name, B, towers, initial)
    moved = max(float(np.abs(a - w).max()) for a, w in zip(one.get_weights(), initial))
    assert moved > 1e-3, "training must move the weights for the comparison to mean anything"
    assert int(one.optimizer.iterations.numpy()) == int(many.optimizer.iterations.numpy()) == 2 * STEPS * 4 // towers
    for a, b, w in zip(one.get_weights(), many.get_weights(), one.weights):
        np.testing.assert_allclose(b, a, atol=1e-5, err_msg=f"{case}/{optimizer_name}: {w.path}")
    assert sorted(one_logs) == sorted(many_logs)
    for key in one_logs:
        np.testing.assert_allclose(many_logs[key], one_logs[key], atol=1e-5, err_msg=f"logged {key}")
