"""On JAX, a step traces per shape: each tower's batch, and a short last
step on fewer towers, can be seen in the traced tower contexts."""

import keras
import numpy as np
import pytest

import kerastower as kt
from tests.jax.helpers import TowerRecorder

SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _batches(n, size):
    rng = np.random.default_rng(0)
    for _ in range(n):
        yield rng.normal(size=(size, 6)).astype("float32"), rng.integers(0, 3, size).astype("int32")


def test_each_tower_takes_a_whole_batch_of_its_own_and_a_short_step_runs_on_fewer():
    recorder = TowerRecorder()
    with kt.distributed("mirrored", devices=[0, 1, 2]):
        inputs = keras.Input((6,))
        model = kt.TowerModel(inputs, keras.layers.Dense(3)(recorder(inputs)))
        model.compile(optimizer="sgd", loss=SCCE)
    # 5 batches of 4 on 3 towers: a step of 3, then one of 2 (on 2 towers).
    model.fit(_batches(5, 4), verbose=0)
    training = sorted(c for c in recorder.contexts if c[2].startswith("tower"))
    assert training == [(0, 2, "tower0", 4), (0, 3, "tower0", 4), (1, 2, "tower1", 4),
                        (1, 3, "tower1", 4), (2, 3, "tower2", 4)]
    assert model.loop.global_step == 2




@pytest.mark.parametrize("structure", ["x", "x_y", "x_y_weights", "list_x", "dict_x", "list_x_alone"])
def test_array_batches_keep_the_structure_of_what_fit_was_given(structure):
    """Batches gathered leaf by leaf come back packed as Keras packs the
    arrays, each leaf's rows in the pass's order."""
    from kerastower.backend.jax.array_batches import ArrayBatches

    n = 10
    a = np.arange(n * 3, dtype="float32").reshape(n, 3)
    b = np.arange(n, dtype="int32") * 10
    w = np.linspace(0, 1, n).astype("float32")
    args = {
        "x": (a, None, None),
        "x_y": (a, b, None),
        "x_y_weights": (a, b, w),
        "list_x": ([a, a + 1], b, None),
        "dict_x": ({"first": a, "second": b[:, None]}, b, None),
        "list_x_alone": ([a, a + 1], None, None),
    }[structure]
    batches = ArrayBatches(*args, batch_size=3, shuffle=True)
    steps = list(batches.one_pass(num_towers=2))
    element = batches._element
    rows = []
    for step in steps:
        for batch in step:
            first = keras.tree.flatten(batch)[0]
            indices = (first[:, 0] // 3).astype(int)
            expected = keras.tree.map_structure(lambda leaf: np.asarray(leaf)[indices], element)
            assert keras.tree.flatten(batch) and type(batch) is type(expected)
            keras.tree.assert_same_structure(batch, expected)
            for got, want in zip(keras.tree.flatten(batch), keras.tree.flatten(expected)):
                np.testing.assert_array_equal(got, want)
            rows.extend(indices.tolist())
    assert sorted(rows) == list(range(n)) and rows != list(range(n))  # every row once, shuffled
