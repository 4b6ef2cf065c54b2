"""Every reduction of Keras's losses on N towers trains and logs as one
device on the joined batch (issue 54, must-have 1), on both backends.

Each test trains the same model (same initial weights) twice: stock
`keras.Model` on one device with batches of 2B, and `kt.TowerModel` on 2
mirrored towers with batches of B over the same arrays (a step's towers
hold the one-device batch; the pass's last step is short: unequal towers
on TensorFlow, one tower on JAX). The weights and every logged value must
agree within 1e-5. The model has an L2-regularised layer: its penalty is
added once to the joined loss whatever the data loss's reduction, so a
"sum" loss cannot be made right by scaling the tower's whole loss.

Where kerastower cannot see the reduction (a loss with `reduction=None`
reduced by the user's own `compute_loss`), it warns once per model.
"""

import warnings

import keras
import numpy as np
import pytest

from tests.helpers.common import tower_devices

import kerastower as kt

B = 4
N = 2 * B * 2 + 6          # two whole steps and a short one (6 examples)
TOL = dict(rtol=1e-5, atol=1e-5)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.3).astype("float32")
    # Unequal weights, not proportional to the towers' examples.
    w = rng.uniform(0.1, 3.0, size=(N,)).astype("float32")
    return x, y, w


def _layers():
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01),
                           name="hidden")(inputs)
    return inputs, keras.layers.Dense(1, name="out")(h)


def _two_outputs():
    inputs = keras.Input((3,))
    h = keras.layers.Dense(4, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01),
                           name="hidden")(inputs)
    return inputs, {"a": keras.layers.Dense(1, name="a")(h), "b": keras.layers.Dense(1, name="b")(h)}


def _fit_both(make, compile_kwargs, fit_kwargs, model_class=kt.TowerModel, epochs=2,
              one_class=keras.Model):
    """(one device's (weights, history), 2 towers' (weights, history))."""
    keras.utils.set_random_seed(7)
    one = one_class(*make())
    initial = one.get_weights()
    one.compile(optimizer=keras.optimizers.SGD(0.02), **compile_kwargs())
    h1 = one.fit(batch_size=2 * B, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
    with kt.distributed("mirrored", devices=tower_devices(2)):
        towers = model_class(*make())
        towers.set_weights(initial)
        towers.compile(optimizer=keras.optimizers.SGD(0.02), **compile_kwargs())
        h2 = towers.fit(batch_size=B, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
    return (one.get_weights(), h1.history), (towers.get_weights(), h2.history)


def _assert_same(one, towers):
    (w1, h1), (w2, h2) = one, towers
    assert set(h1) == set(h2), (sorted(h1), sorted(h2))
    for key in h1:
        np.testing.assert_allclose(h2[key], h1[key], err_msg=key, **TOL)
    for a, b in zip(w1, w2):
        np.testing.assert_allclose(b, a, **TOL)


@pytest.mark.parametrize("weighted", [True, False], ids=["sample_weight", "unweighted"])
@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight"])
def test_each_reduction_on_two_towers_equals_one_device(reduction, weighted):
    x, y, w = _data()
    xv, yv, wv = _data(seed=1)
    # Validation too: 10 examples, a short last step.
    fit_kwargs = dict(x=x, y=y, sample_weight=w if weighted else None,
                      validation_data=(xv[:10], yv[:10], wv[:10] if weighted else None))
    one, towers = _fit_both(
        _layers, lambda: dict(loss=keras.losses.MeanSquaredError(reduction=reduction)), fit_kwargs)
    _assert_same(one, towers)


def test_outputs_with_their_own_reductions_and_weights_train_and_validate_as_one_device():
    """Two outputs, one summed and one weighted-mean, with loss_weights: the
    total, each output's logged loss and the validation losses too (whole
    steps: Keras's per-output trackers count a batch once whatever its
    size, so a step of unequal towers is the towers' mean there)."""
    x, y, w = (a[:4 * B] for a in _data())
    xv, yv, wv = _data(seed=1)
    ys = {"a": y, "b": -y}
    fit_kwargs = dict(x=x, y=ys, sample_weight={"a": w, "b": w[::-1].copy()},
                      validation_data=(xv[:16], {"a": yv[:16], "b": -yv[:16]},
                                       {"a": wv[:16], "b": wv[:16]}))

    def compile_kwargs():
        return dict(loss={"a": keras.losses.MeanSquaredError(reduction="sum"),
                          "b": keras.losses.MeanAbsoluteError(reduction="mean_with_sample_weight")},
                    loss_weights={"a": 0.5, "b": 2.0})

    one, towers = _fit_both(_two_outputs, compile_kwargs, fit_kwargs)
    _assert_same(one, towers)


class OwnSum(kt.TowerModel):
    """A loss kerastower cannot see reduced: unreduced, summed by the user."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.per_example = keras.losses.MeanSquaredError(reduction=None)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return keras.ops.sum(self.per_example(y, y_pred))


class OwnJoined(OwnSum):
    """The same loss, normalised over the joined batch with kt.loss_divisor."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        values = self.per_example(y, y_pred)
        count = keras.ops.cast(keras.ops.shape(values)[0], "float32")
        return keras.ops.sum(values) / kt.loss_divisor(count)


class _SumOverShare:
    """A sum over the batch of one's own, divided by the tower's share of
    the step's examples (1 on one device): the joined batch's sum."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        ctx = kt.get_current_tower_context()
        share = 1.0 if ctx is None else ctx.example_weight
        data = keras.ops.sum(keras.ops.square(y - y_pred)) / share
        return data + sum(self.losses)


class OwnSumStock(_SumOverShare, keras.Model):
    pass


class OwnSumOverShare(_SumOverShare, kt.TowerModel):
    pass


def test_a_sum_of_ones_own_divided_by_the_towers_share_equals_one_device():
    """What the warning advises for a sum over the joined batch."""
    x, y, _ = _data()
    one, towers = _fit_both(_layers, dict, dict(x=x, y=y), model_class=OwnSumOverShare,
                            one_class=OwnSumStock)
    _assert_same(one, towers)


def _kerastower_warnings(record):
    return [str(r.message) for r in record if str(r.message).startswith("kerastower")]


def _fit_towers(model_class, compile_kwargs, epochs=2):
    x, y, _ = _data()
    keras.utils.set_random_seed(7)
    with kt.distributed("mirrored", devices=tower_devices(2)):
        model = model_class(*_layers())
        model.compile(optimizer=keras.optimizers.SGD(0.02), **compile_kwargs)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0)
            model.evaluate(x, y, batch_size=B, verbose=0)
    return _kerastower_warnings(record)


def test_a_reduction_kerastower_cannot_see_is_warned_about_once():
    messages = _fit_towers(OwnSum, {})
    assert len(messages) == 1, messages
    message = messages[0]
    assert "OwnSum" in message and "reduction=None" in message
    assert "n_k / n" in message and "kt.loss_divisor" in message


@pytest.mark.parametrize("model_class,compile_kwargs", [
    (kt.TowerModel, dict(loss=keras.losses.MeanSquaredError(reduction="sum"))),
    (kt.TowerModel, dict(loss="mse")),
    (OwnJoined, {}),
    (OwnSumOverShare, {}),
], ids=["compiled_sum", "compiled_mean", "loss_divisor", "example_weight"])
def test_reductions_kerastower_sees_give_no_warning(model_class, compile_kwargs):
    assert _fit_towers(model_class, compile_kwargs, epochs=1) == []
