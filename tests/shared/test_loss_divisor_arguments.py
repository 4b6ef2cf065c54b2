"""`kt.loss_divisor` and `kt.global_sum` check what they are given (issue 54).

`kt.loss_divisor(count)` takes one number, the tower's total count (of
tokens, of examples); a count per example used to fail on 2 towers with
TensorFlow's raw `Pack` shape error and to divide elementwise on one.
Both functions now raise `kt.errors.ArgumentError` naming what they got
(its dtype and shape, or its repr) and what they expect, outside a tower,
on one tower and on N alike, on both backends.
"""

import re

import keras
import numpy as np
import pytest

from tests.helpers.common import tower_devices

import kerastower as kt

B = 4


@pytest.mark.parametrize("count, got", [
    (np.ones(3, "float32"), "a float32 array of shape (3,)"),
    ([2, 3], "list of shape (2,)"),
    ("3", "'3' (str)"),
    (None, "None (NoneType)"),
    (True, "True (bool)"),
    (2 + 1j, "(2+1j) (complex)"),
])
def test_loss_divisor_names_what_is_not_one_count(count, got):
    with pytest.raises(kt.errors.ArgumentError, match=r"kt\.loss_divisor: count must be") as caught:
        kt.loss_divisor(count)
    message = str(caught.value)
    assert got in message and "scalar" in message and "keras.ops.sum(mask)" in message


def test_loss_divisor_checks_examples_too():
    with pytest.raises(kt.errors.ArgumentError, match=r"examples must be one number.*shape \(2,\)"):
        kt.loss_divisor(3.0, examples=np.array([1, 2]))


@pytest.mark.parametrize("value, got", [
    ("3", "'3' (str)"), (None, "None (NoneType)"), (2 + 1j, "(2+1j) (complex)"),
    (np.array(["a"]), "array of shape (1,)"),
])
def test_global_sum_names_what_is_not_a_real_value(value, got):
    with pytest.raises(kt.errors.ArgumentError, match=r"kt\.global_sum: value must be") as caught:
        kt.global_sum(value)
    assert got in str(caught.value)


def test_what_they_take_outside_a_tower():
    assert float(kt.loss_divisor(np.int64(7))) == 7.0
    assert float(kt.loss_divisor(keras.ops.convert_to_tensor(5, "int32"), examples=2)) == 5.0
    summed = kt.global_sum(np.array([1, 2], "int32"))   # any shape, ints and bools cast
    assert keras.ops.convert_to_numpy(summed).tolist() == [1.0, 2.0]
    assert float(kt.global_sum(np.bool_(True))) == 1.0


class CountPerExample(kt.TowerModel):
    """A mistake: one count per example where the total is wanted."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        values = keras.losses.MeanSquaredError(reduction=None)(y, y_pred)
        return keras.ops.sum(values) / kt.loss_divisor(keras.ops.ones_like(values))


class IntegerGlobalSum(kt.TowerModel):
    """The joined batch's mean through kt.global_sum of an int32 count."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        values = keras.losses.MeanSquaredError(reduction=None)(y, y_pred)
        count = keras.ops.cast(keras.ops.shape(values)[0], "int32")
        towers = kt.get_current_tower_context()
        share = 1.0 if towers is None else towers.example_weight
        return keras.ops.sum(values) / (kt.global_sum(count) * share)


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * B, 3)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], "float32")).astype("float32")


def _fit(model_class, num_towers):
    x, y = _data()
    keras.utils.set_random_seed(3)
    with kt.distributed("mirrored", devices=tower_devices(num_towers)):
        inputs = keras.Input((3,))
        model = model_class(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.05))
        model.fit(x, y, batch_size=B * 2 // num_towers, epochs=1, shuffle=False, verbose=0)
        return model


def test_a_count_per_example_is_the_same_clear_error_on_one_and_two_towers():
    messages = []
    for towers in (1, 2):
        with pytest.raises(kt.errors.ArgumentError) as caught:
            _fit(CountPerExample, towers)
        # TensorFlow prefixes the traced step's frames; the error is the last line.
        found = re.search(r"kt\.loss_divisor: count must be one number.*", str(caught.value))
        assert found, str(caught.value)
        messages.append(found.group(0))
    # Each tower's batch is 8 on one tower, 4 on two (TensorFlow's towers
    # may trace the batch dimension as None); the rest of the message is one.
    assert re.search(r"got a float32 tensor of shape \((8|None),\)", messages[0]), messages[0]
    assert re.search(r"got a float32 tensor of shape \((4|None),\)", messages[1]), messages[1]
    same = [re.sub(r"of shape \(\w+,\)", "of shape (batch,)", m) for m in messages]
    assert same[0] == same[1]


def test_global_sum_of_an_int_count_in_towers_equals_one_device():
    one = _fit(IntegerGlobalSum, 1).get_weights()
    two = _fit(IntegerGlobalSum, 2).get_weights()
    for a, b in zip(one, two):
        np.testing.assert_allclose(b, a, atol=1e-6)
