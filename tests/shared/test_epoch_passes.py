"""One tower's epochs over numpy arrays read each pass whole, in its order, on both backends.

On one tower `fit(x, y)` reads the passes in a row from one placed stream
(an epoch takes exactly a pass's batches); the proof is a differential
test against stock Keras's `train_on_batch` on the batches `ArrayRows`
cuts, pass by pass (in stock Keras's own order of the seed the tests set): a pass that began mid-stream, lost its short last batch
or took another order would end elsewhere.
"""

import keras
import numpy as np
import pytest

import kerastower as kt
from kerastower.inputs import keras_order
from kerastower.inputs.array_rows import ArrayRows

N, B, EPOCHS = 10, 4, 3   # passes of 4, 4 and 2 examples


def _dense(model_class):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((3,))
    model = model_class(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 3)).astype("float32"), rng.normal(size=(N, 2)).astype("float32")


@pytest.mark.parametrize("shuffle", [False, True])
def test_one_tower_epochs_equal_train_on_batch_over_each_pass(shuffle):
    x, y = _data()
    with kt.distributed("single"):
        tower = _dense(kt.TowerModel)
    stock = _dense(keras.Model)
    stock.set_weights(tower.get_weights())
    # The order fit reads the passes in, made here as fit makes it: where
    # an earlier test set Keras's seed, stock Keras's order on this backend
    # (inputs/keras_order.py), else kerastower's seeded one; numpy's
    # generator at the same point.
    np.random.seed(7)
    history = tower.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=shuffle, verbose=0)
    np.random.seed(7)
    rows = ArrayRows(N, B, shuffle)
    keras_order.follow_keras(rows, tower.tower_strategy, tower.engine.pass_order)
    rows.fix_seed()  # where no Keras seed is set: drawn as fit draws it
    if hasattr(rows.pass_order, "peek"):
        rows.pass_order.peek()  # on JAX, fit's build read a batch first, as Keras's does
    losses = []
    for pass_index in range(EPOCHS):
        total = 0.0
        for batch in rows.batches_of_pass(pass_index):
            # The epoch's loss: each batch's, before its update, weighted by its size.
            total += np.mean((stock.predict_on_batch(x[batch]) - y[batch]) ** 2) * len(batch)
            stock.train_on_batch(x[batch], y[batch])
        losses.append(total / N)
    for mine, theirs in zip(tower.get_weights(), stock.get_weights()):
        np.testing.assert_allclose(mine, theirs, atol=1e-6)
    assert len(history.history["loss"]) == EPOCHS
    np.testing.assert_allclose(history.history["loss"], losses, atol=1e-6)


@pytest.mark.parametrize("rows", [16, 18])   # passes of 2 whole steps; of 3, the last on tower 0 alone
def test_two_towers_epochs_equal_one_device_on_each_steps_joined_batches(rows):
    """2 towers read the passes in a row where every step of a pass fills
    both (16 rows: 4 batches of 4 a pass), else each pass afresh (18
    rows: 5 batches, the last short and tower 0's alone); either way step s
    of a pass takes its batches 2s and 2s + 1, shuffled per pass as one
    tower's: against stock Keras's `train_on_batch` on each step's joined
    batch."""
    from tests.helpers.common import tower_devices

    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(rows, 3)).astype("float32"), rng.normal(size=(rows, 2)).astype("float32")
    with kt.distributed("mirrored", devices=tower_devices(2)):
        towers = _dense(kt.TowerModel)
    stock = _dense(keras.Model)
    stock.set_weights(towers.get_weights())
    np.random.seed(7)
    towers.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=True, verbose=0)
    np.random.seed(7)
    order = ArrayRows(rows, B, True)
    keras_order.follow_keras(order, towers.tower_strategy, towers.engine.pass_order)
    order.fix_seed()
    if hasattr(order.pass_order, "peek"):
        order.pass_order.peek()
    for pass_index in range(EPOCHS):
        batches = list(order.batches_of_pass(pass_index))
        for step in range(0, len(batches), 2):
            joined = np.concatenate(batches[step:step + 2])
            stock.train_on_batch(x[joined], y[joined])
    assert towers.loop.global_step == EPOCHS * -(-rows // (2 * B))
    for mine, theirs in zip(towers.get_weights(), stock.get_weights()):
        np.testing.assert_allclose(mine, theirs, atol=1e-6)
