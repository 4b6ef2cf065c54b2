"""train_on_batch, test_on_batch, predict_on_batch: Keras's on one tower,
the joined batch on N towers (tower k takes its k-th equal part)."""

import keras
import numpy as np
import pytest

from tests.helpers.common import tower_devices

import kerastower as kt

SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 5)).astype("float32"), rng.integers(0, 3, n).astype("int32"),
            rng.uniform(0.5, 2.0, n).astype("float32"))


def _layers():
    keras.utils.set_random_seed(5)
    inputs = keras.Input((5,))
    outputs = keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(inputs))
    return inputs, outputs


def _compiled(model):
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=SCCE,
                  metrics=["accuracy", keras.metrics.SparseCategoricalCrossentropy(from_logits=True)])
    return model


def _stock():
    return _compiled(keras.Model(*_layers()))


def _tower_model(towers):
    with kt.distributed("mirrored", devices=tower_devices(towers)):
        return _compiled(kt.TowerModel(*_layers()))


def _calls(model, batches):
    """What each single-batch method gives, call after call (the metrics go on)."""
    out = []
    for x, y, w in batches:
        out.append(("train", model.train_on_batch(x, y, sample_weight=w, return_dict=True)))
    out.append(("train list", model.train_on_batch(*batches[0][:2])))
    x, y, w = batches[1]
    out.append(("test", model.test_on_batch(x, y, sample_weight=w, return_dict=True)))
    out.append(("test list", model.test_on_batch(x, y)))
    out.append(("predict", model.predict_on_batch(x)))
    return out


def _assert_same(got, want, got_model, want_model):
    for (name, a), (_, b) in zip(got, want):
        if isinstance(b, dict):
            assert sorted(a) == sorted(b), name
            for key in b:
                np.testing.assert_allclose(a[key], b[key], atol=1e-5, err_msg=f"{name}: {key}")
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=name)
    for a, b in zip(got_model.get_weights(), want_model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_on_one_tower_the_single_batch_methods_are_keras_own():
    batches = [_data(12, seed) for seed in range(3)]
    stock, tower = _stock(), _tower_model(1)
    want = _calls(stock, batches)
    got = _calls(tower, batches)
    _assert_same(got, want, tower, stock)
    assert int(tower.optimizer.iterations.numpy()) == int(stock.optimizer.iterations.numpy()) == 4
    assert tower.loop.global_step == 4


@pytest.mark.parametrize("towers", [2, 4])
def test_on_n_towers_the_batch_is_the_joined_batch(towers):
    batches = [_data(16, seed) for seed in range(3)]
    one, many = _tower_model(1), _tower_model(towers)
    want = _calls(one, batches)
    got = _calls(many, batches)
    moved = any(not np.allclose(a, b) for a, b in zip(one.get_weights(), _stock().get_weights()))
    assert moved, "the steps must change the weights for the comparison to mean anything"
    _assert_same(got, want, many, one)


def test_a_batch_the_towers_cannot_share_equally_is_refused_naming_the_sizes():
    model = _tower_model(2)
    x, y, _ = _data(7)
    with pytest.raises(kt.DataMismatchError, match="7 examples.*2 towers"):
        model.train_on_batch(x, y)
    with pytest.raises(kt.DataMismatchError, match="7 examples.*2 towers"):
        model.predict_on_batch(x)
    with pytest.raises(kt.DataMismatchError, match=r"same number of examples.*\[6, 7\]"):
        model.test_on_batch(x, y[:6])
    assert model.loop.global_step == 0
