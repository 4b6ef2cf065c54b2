"""Gradient accumulation on N towers against one device on the joined
k x N x B examples (issue 54, must-have 3), on both backends.

`optimizer(gradient_accumulation_steps=k)` applies one update every k
steps. On N towers of B examples, that update must be the one of one
device on the k x N x B examples of those k steps: the gradient of the
joined batch's loss, its mean over all of them (a masked loss: its sum
over the tokens of all k x N micro-batches divided by their count, not
the mean of the k micro-steps' own token means, which is what Keras's
accumulation gives when the micro-batches hold unequal token counts).

The one-device reference is stock `keras.Model` without accumulation on
batches of k x N x B (for a masked loss: a TowerModel on one tower, whose
masked loss divides by its batch's tokens as stock Keras does). The
epoch's logged loss and metrics are then one device's too: every example
is seen at the same weights in both.
"""


import keras
import numpy as np
import pytest

from tests.helpers.common import SigtermAt
from tests.helpers.common import tower_devices

import kerastower as kt

B = 4
TOL = dict(rtol=1e-5, atol=1e-5)


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.3
         + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def _layers():
    inputs = keras.Input((3,))
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    return inputs, keras.layers.Dense(1, name="out")(h)


def _optimizer(name, k=None):
    if name == "adam":
        return keras.optimizers.Adam(0.05, gradient_accumulation_steps=k)
    return keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=k)


def _towers(n, make, compile_kwargs):
    with kt.distributed("mirrored", devices=tower_devices(n)):
        model = kt.TowerModel(*make())
        # The optimizer is made in the strategy's scope, as stock Keras needs.
        compile_kwargs = dict(compile_kwargs, optimizer=compile_kwargs["optimizer"]())
        model.compile(**compile_kwargs)
    return model


def _close(got, want, what, **tol):
    tol = tol or TOL
    assert sorted(got[1]) == sorted(want[1]), what
    for key in want[1]:
        np.testing.assert_allclose(got[1][key], want[1][key], err_msg=f"{what}: {key}", **tol)
    for a, b in zip(got[0], want[0]):
        np.testing.assert_allclose(a, b, err_msg=f"{what}: weights", **tol)


def _fit(model, x, y, batch_size, epochs=2):
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0).history
    return model.get_weights(), history


# k = 1 is no accumulation (Keras refuses gradient_accumulation_steps=1):
# the equivalence matrix's cases.
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("k", [2, 4])
def test_accumulation_on_two_towers_is_one_device_on_the_joined_batch(k, optimizer):
    x, y = _data()
    keras.utils.set_random_seed(7)
    one = keras.Model(*_layers())
    start = one.get_weights()
    one.compile(optimizer=_optimizer(optimizer), loss="mse", metrics=["mae"])
    want = _fit(one, x, y, batch_size=k * 2 * B)
    towers = _towers(2, _layers, dict(optimizer=lambda: _optimizer(optimizer, k), loss="mse", metrics=["mae"]))
    towers.set_weights(start)
    got = _fit(towers, x, y, batch_size=B)
    _close(got, want, f"k={k}")
    # One update per k steps: the optimizer's iterations count updates.
    assert int(keras.ops.convert_to_numpy(towers.optimizer.iterations)) == int(
        keras.ops.convert_to_numpy(one.optimizer.iterations))


@pytest.mark.parametrize("k", [2, 3])
def test_accumulation_on_one_tower_is_stock_keras(k):
    x, y = _data(n=48)
    keras.utils.set_random_seed(7)
    stock = keras.Model(*_layers())
    start = stock.get_weights()
    stock.compile(optimizer=_optimizer("adam", k), loss="mse", metrics=["mae"])
    want = _fit(stock, x, y, batch_size=B)
    tower = _towers(1, _layers, dict(optimizer=lambda: _optimizer("adam", k), loss="mse", metrics=["mae"]))
    tower.set_weights(start)
    got = _fit(tower, x, y, batch_size=B)
    _close(got, want, f"k={k}", rtol=1e-6, atol=1e-6)
    assert int(keras.ops.convert_to_numpy(tower.optimizer._iterations)) == int(
        keras.ops.convert_to_numpy(stock.optimizer._iterations))


# -- token-normalised masked losses ----------------------------------------------

T, VOCAB = 6, 7


def _sequences(batches=8):
    """Batches of B rows that alternate short (1-2 tokens) and full rows,
    so consecutive micro-batches hold very unequal token counts."""
    rng = np.random.default_rng(0)
    rows = []
    for batch in range(batches):
        lengths = rng.integers(1, 3, B) if batch % 3 == 0 else rng.integers(4, T + 1, B)
        for length in lengths:
            row = np.zeros(T + 1, "int32")
            row[:length + 1] = rng.integers(1, VOCAB, length + 1)
            rows.append(row)
    rows = np.stack(rows)
    x, y = rows[:, :-1].copy(), rows[:, 1:].copy()
    y[x == 0] = 0
    return x, y


def _masked_layers():
    inputs = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 5, mask_zero=True)(inputs)
    h = keras.layers.Dense(8, activation="tanh")(h)
    return inputs, keras.layers.Dense(VOCAB)(h)


def _masked_compile(k=None):
    return dict(optimizer=lambda: keras.optimizers.SGD(0.5, gradient_accumulation_steps=k),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])


@pytest.mark.parametrize("towers,k", [(1, 2), (2, 2), (2, 4)])
def test_accumulation_of_a_masked_loss_divides_by_the_tokens_of_all_micro_batches(towers, k):
    """The update of each cycle is one device's on its k x N x B examples,
    the summed token losses divided by all their tokens; the epoch's
    metrics are one device's too, and its loss the mean of the micro-steps'
    own (joined over the towers) token means."""
    x, y = _sequences()
    keras.utils.set_random_seed(3)
    one = _towers(1, _masked_layers, _masked_compile())
    start = one.get_weights()
    history = one.fit(x, y, batch_size=k * towers * B, epochs=2, shuffle=False, verbose=0).history
    want = one.get_weights(), history
    keras.utils.set_random_seed(3)
    many = _towers(towers, _masked_layers, _masked_compile(k))
    many.set_weights(start)
    got = _fit(many, x, y, batch_size=B, epochs=2)
    for a, b in zip(got[0], want[0]):
        np.testing.assert_allclose(a, b, err_msg=f"{towers} towers, k={k}: weights", **TOL)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(got[1][key], want[1][key], err_msg=key, **TOL)


def test_keras_own_accumulation_is_not_the_joined_batch_for_a_masked_loss():
    """The bug class the tests above guard against: stock Keras averages the
    micro-steps' token means (transformers #34191)."""
    x, y = _sequences()
    keras.utils.set_random_seed(3)
    one = keras.Model(*_masked_layers())
    one.compile(**dict(_masked_compile(), optimizer=keras.optimizers.SGD(0.5)))
    start = one.get_weights()
    want = _fit(one, x, y, batch_size=2 * B)
    stock = keras.Model(*_masked_layers())
    stock.compile(**dict(_masked_compile(), optimizer=keras.optimizers.SGD(0.5, gradient_accumulation_steps=2)))
    stock.set_weights(start)
    got = _fit(stock, x, y, batch_size=B)
    assert max(np.max(np.abs(a - b)) for a, b in zip(got[0], want[0])) > 1e-4


def test_a_step_with_two_counted_losses_warns_that_it_averages_as_keras():
    """Two masked outputs: no one count to weigh the micro-steps by."""
    def two_outputs():
        inputs = keras.Input((T,), dtype="int32")
        h = keras.layers.Embedding(VOCAB, 5, mask_zero=True)(inputs)
        return inputs, [keras.layers.Dense(VOCAB, name="a")(h), keras.layers.Dense(VOCAB, name="b")(h)]

    x, y = _sequences(batches=4)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = _towers(2, two_outputs, dict(optimizer=lambda: keras.optimizers.SGD(0.5, gradient_accumulation_steps=2),
                                         loss=[loss, loss]))
    with pytest.warns(UserWarning, match="averages them as Keras does"):
        model.fit(x, [y, y], batch_size=B, epochs=1, shuffle=False, verbose=0)


def _fit_resumable(folder, k, stop=None, masked=False):
    keras.utils.set_random_seed(3)
    if masked:
        model = _towers(2, _masked_layers, dict(_masked_compile(k), metrics=None))
        x, y = _sequences()
    else:
        model = _towers(2, _layers, {"optimizer": lambda: _optimizer("adam", k), "loss": "mse"})
        x, y = _data()
    callbacks = [kt.callbacks.AutoResume(str(folder)), kt.callbacks.ModelSaver(str(folder))]
    model.fit(x, y, batch_size=B, epochs=3, shuffle=False, verbose=0,
              callbacks=callbacks + ([] if stop is None else [stop]))
    return model


@pytest.mark.parametrize("stop_at,masked", [(5, False), (11, False), (5, True)])
def test_a_resume_in_the_middle_of_an_accumulation_cycle_is_bit_equal(tmp_path, stop_at, masked):
    """Preempted after micro-step 2 of a cycle of 3 (the accumulators hold
    two steps' gradients; with a masked loss, the cycle's token count so
    far too), the resumed run's weights, updates and micro-step count are
    the uninterrupted run's, bit for bit."""
    whole = _fit_resumable(tmp_path / "whole", 3, masked=masked)
    with pytest.raises(kt.Preempted):
        _fit_resumable(tmp_path / "resumed", 3, stop=SigtermAt(stop_at), masked=masked)
    resumed = _fit_resumable(tmp_path / "resumed", 3, masked=masked)
    assert int(np.asarray(resumed.optimizer.iterations)) == int(np.asarray(whole.optimizer.iterations))
    for a, b in zip(resumed.get_weights(), whole.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(resumed.optimizer.variables, whole.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)
