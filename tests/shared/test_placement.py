"""Each engine places what the input layer decided, on both backends.

The input layer (kerastower/inputs/) decides which batch each tower takes,
tower k of step s batch s*N+k; `StepEngine.place` puts those batches where
the engine's step reads them. Read back per tower, what each engine placed
must be that decision: the rows `ArrayRows` cut for numpy arrays, and the
generator's items in order for a Python source.
"""

import keras
import numpy as np
import pytest

from tests.helpers.common import BACKEND
from tests.helpers.common import tower_devices

import kerastower as kt
from kerastower.inputs.array_rows import ArrayRows

TOWERS, B = 2, 3


def _model():
    with kt.distributed("mirrored", devices=tower_devices(TOWERS)):
        inputs = keras.Input((1,))
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    return model


def _placed_ids(model, placed):
    """[[tower 0's example ids, tower 1's ...] for every step] of what `place` gave."""
    steps = []
    for step in placed:
        if BACKEND == "tensorflow":
            batches = model.tower_strategy.tower_values(step[0])
        else:
            batches = [batch[0] for batch in step]
        steps.append([np.asarray(batch)[:, 0].astype(int).tolist() for batch in batches])
    return steps


def _decided(rows, pass_index, skip_steps=0):
    return [[r.tolist() for r in step] for step in rows.steps_of_pass(TOWERS, pass_index, skip_steps)]


@pytest.mark.parametrize("pass_index", [0, 3])
def test_shuffled_arrays_are_placed_as_the_rows_were_decided(pass_index):
    model = _model()
    n = 16   # 6 batches of 3 and one of 1: the last step has one tower only
    x = np.arange(n, dtype="float32")[:, None]
    source = model.engine.input_source(x, x, batch_size=B, shuffle=True)
    # The rows fit decided on: kerastower's seeded order, or stock Keras's
    # where an earlier test set Keras's seed (inputs/keras_order.py).
    rows = source.rows
    placed = _placed_ids(model, model.engine.place(source, pass_index=pass_index))
    decided = _decided(rows, pass_index)
    if BACKEND == "jax":
        # JAX runs a pass's short last step as one tower on its examples.
        decided[-1] = [sum(decided[-1], [])]
    else:
        # TensorFlow hands a tower without a batch an empty one.
        decided[-1] += [[]] * (TOWERS - len(decided[-1]))
    assert placed == decided
    assert decided != _decided(ArrayRows(n, B), pass_index)   # shuffled, not in place


def test_a_resumed_pass_is_placed_from_where_the_towers_stopped():
    model = _model()
    x = np.arange(24, dtype="float32")[:, None]
    source = model.engine.input_source(x, x, batch_size=B, shuffle=True)
    rows = source.rows
    placed = _placed_ids(model, model.engine.place(source, pass_index=1, skip_batches=[2, 2]))
    assert placed == _decided(rows, 1, skip_steps=2)


def test_a_generator_is_placed_item_by_item_in_order():
    model = _model()

    def batches():
        for start in range(0, 12, B):
            ids = np.arange(start, start + B, dtype="float32")[:, None]
            yield ids, ids

    source = model.engine.input_source(batches(), method="evaluate")
    assert _placed_ids(model, model.engine.place(source)) == [
        [[0, 1, 2], [3, 4, 5]], [[6, 7, 8], [9, 10, 11]]]
