"""A torch `DataLoader` as fit's input, on both backends (issue 26, item 1).

Keras 3 takes a torch DataLoader on every backend. kerastower reads it as
any other re-iterable source: iterated afresh every pass, each tensor
turned into a numpy array, and tower k of step s takes batch s * N + k. On
one tower it must train as stock Keras on the same DataLoader; on N towers
as one device on the N batches of each step joined; and a resumed run must
equal an uninterrupted one (the DataLoader gives the same batches every
pass when it does not shuffle). These tests run where torch is installed
(the README's install brings its CPU build).
"""

import keras
import numpy as np
import pytest

from tests.helpers.common import Stop
from tests.helpers.common import StopAt
from tests.helpers.common import tower_devices

import kerastower as kt

torch = pytest.importorskip("torch")

B = 8


def _arrays(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = rng.integers(0, 3, n).astype("int64")
    return x, y


def _loader(x, y, batch_size=B):
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False)


def _model(base=kt.TowerModel, towers=1):
    def build():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        model = base(inputs, keras.layers.Dense(3)(hidden))
        model.compile(optimizer=keras.optimizers.Adam(0.03),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    if base is keras.Model:
        return build()
    with kt.distributed("mirrored", devices=tower_devices(towers)):
        return build()


def _assert_same(got_model, want_model, got_history, want_history):
    for got, want, variable in zip(got_model.get_weights(), want_model.get_weights(),
                                   want_model.weights):
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=variable.path)
    assert sorted(got_history) == sorted(want_history)
    for key in want_history:
        np.testing.assert_allclose(got_history[key], want_history[key], atol=1e-5, err_msg=key)


def test_one_tower_on_a_dataloader_trains_as_stock_keras():
    x, y = _arrays(13 * B + 5)          # a short last batch
    stock, tower = _model(keras.Model), _model()
    tower.set_weights(stock.get_weights())
    want = stock.fit(_loader(x, y), epochs=2, verbose=0).history
    got = tower.fit(_loader(x, y), epochs=2, verbose=0).history
    _assert_same(tower, stock, got, want)
    assert tower.loop.global_step == 28
    np.testing.assert_allclose(tower.evaluate(_loader(x, y), verbose=0),
                               stock.evaluate(_loader(x, y), verbose=0), atol=1e-5)
    np.testing.assert_allclose(tower.predict(_loader(x, y), verbose=0),
                               stock.predict(_loader(x, y), verbose=0), atol=1e-5)


@pytest.mark.parametrize("towers", [2, 4])
def test_towers_on_a_dataloader_equal_one_device_on_the_joined_batches(towers):
    x, y = _arrays(16 * B)
    one, many = _model(), _model(towers=towers)
    many.set_weights(one.get_weights())
    want = one.fit(x, y, batch_size=towers * B, epochs=2, shuffle=False, verbose=0).history
    got = many.fit(_loader(x, y), epochs=2, verbose=0).history
    assert many.loop.global_step == 2 * 16 // towers
    _assert_same(many, one, got, want)
    # predict gives the DataLoader's examples in order, each once.
    np.testing.assert_allclose(many.predict(_loader(x, y), verbose=0),
                               one.predict(x, batch_size=B, verbose=0), atol=1e-5)


def _train(folder, extra=(), epochs=3):
    x, y = _arrays(7 * B, seed=4)
    model = _model(towers=2)
    callbacks = [kt.callbacks.AutoResume(folder),
                 kt.callbacks.PeriodicTrigger(kt.callbacks.ModelSaver(folder), every_k_steps=3),
                 *extra]
    model.fit(_loader(x, y), epochs=epochs, verbose=0, callbacks=callbacks)
    return model


def test_a_resumed_run_on_a_dataloader_equals_an_uninterrupted_one(tmp_path):
    whole = _train(str(tmp_path / "a"))
    with pytest.raises(Stop):
        _train(str(tmp_path / "b"), [StopAt(7)])
    assert kt.checkpoint.latest_checkpoint(str(tmp_path / "b")).endswith("ckpt-00000006")
    resumed = _train(str(tmp_path / "b"))
    assert int(resumed.optimizer.iterations.numpy()) == int(whole.optimizer.iterations.numpy()) == 12
    for a, b in zip(whole.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Without the input position the batches would differ: the test can fail.
    shorter = _train(str(tmp_path / "c"), epochs=2)
    assert any(not np.array_equal(a, b) for a, b in zip(whole.get_weights(), shorter.get_weights()))
