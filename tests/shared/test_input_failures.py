"""Input failures name the tower and batch; an input of no batch says so (issue 55, must-have 4).

On both backends and for every Python input kind (a generator, a
PyDataset), a batch that raises is named by the tower that takes it and its
number in the pass: on 2 towers, tower k of step s takes batch 2s + k, so
batch 5 is tower 1's of the pass's step 3 (reading a step's batches in
one go, the tower that asked first used to be named). The user's exception
is the error's cause.

fit on an input that gives no batch (numpy arrays of 0 examples, a
tf.data.Dataset of 0 batches) returns an empty history, as stock Keras's
does, with a warning that nothing was trained; the other kinds (an empty
generator or PyDataset) raise InputSourceError at once.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf


import kerastower as kt


class BadRecord(Exception):
    """The user's own error, which must reach them as the cause."""


def _batch(index):
    x = np.full((4, 3), index, "float32")
    return x, x.sum(axis=1, keepdims=True)


class RaisingBatches(keras.utils.PyDataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        if index == 5:
            raise BadRecord(f"batch {index} is corrupt")
        return _batch(index)


def _raising_generator():
    for index in range(8):
        if index == 5:
            raise BadRecord(f"batch {index} is corrupt")
        yield _batch(index)


def _model():
    inputs = keras.Input((3,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("make", [RaisingBatches, _raising_generator],
                         ids=["pydataset", "generator"])
def test_a_batch_that_raises_is_named_by_its_tower_and_number(two_towers, make):
    model = _model()
    with pytest.raises(Exception) as caught:
        model.fit(make(), epochs=1, verbose=0, shuffle=False)
    message = str(caught.value)
    assert "failed on tower 1" in message, message
    assert "batch 5 of the pass" in message and "step 3 of the pass" in message, message
    assert "BadRecord: batch 5 is corrupt" in message, message
    assert isinstance(caught.value.__cause__, BadRecord)
    assert isinstance(caught.value, kt.StepFailedError)


def _no_arrays():
    return (np.zeros((0, 3), "float32"), np.zeros((0, 1), "float32"))


def _no_tf_batches():
    return (tf.data.Dataset.from_tensor_slices(_no_arrays()).batch(4),)


@pytest.mark.parametrize("make", [_no_arrays, _no_tf_batches], ids=["arrays", "tf_data"])
def test_fit_on_an_input_of_no_batch_warns_that_nothing_was_trained(two_towers, make):
    model = _model()
    before = [w.copy() for w in model.get_weights()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            history = model.fit(*make(), epochs=3, verbose=0)
        except kt.InputSourceError as error:   # a backend that finds it out at once
            assert "no batch" in str(error) or "empty" in str(error)
            return
    said = [str(w.message) for w in caught if "fit trained nothing" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]   # once, not once an epoch
    assert "the input gave no batch" in said[0]
    assert history.history == {}
    assert model.loop.global_step == 0
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["generator", "pydataset"])
def test_fit_on_an_empty_generator_or_pydataset_raises_naming_it(kind):
    class Empty(keras.utils.PyDataset):
        def __len__(self):
            return 0

        def __getitem__(self, index):
            raise IndexError(index)

    source = (b for b in []) if kind == "generator" else Empty()
    with pytest.raises(kt.InputSourceError, match="is empty"):
        _model().fit(source, epochs=1, verbose=0)


def test_a_shuffled_pydatasets_batch_that_raises_is_named_by_its_place_in_the_pass(two_towers):
    """fit's shuffle deals the PyDataset's batches in another order: the
    error names the place the batch had in the pass (its tower and step)
    and the dataset's own index."""
    model = _model()
    with pytest.raises(kt.StepFailedError) as caught:
        model.fit(RaisingBatches(), epochs=1, verbose=0)
    message = str(caught.value)
    import re
    found = re.search(r"failed on tower (\d): .*\(making batch (\d) of the pass, counted from 0"
                      r"(?: \(the source's index (\d): fit's shuffle\))?: tower (\d)'s batch of "
                      r"step (\d) of the pass, on 2 tower", message)
    assert found, message
    tower, number, index, tower_again, step = found.groups()
    assert (int(tower), int(tower_again), int(step)) == (
        int(number) % 2, int(number) % 2, int(number) // 2 + 1), message
    assert (int(index) if index is not None else int(number)) == 5, message
    assert isinstance(caught.value.__cause__, BadRecord)
