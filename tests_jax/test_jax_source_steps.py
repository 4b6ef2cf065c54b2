"""On JAX, a step traces per shape: each tower's batch, and a short last
step on fewer towers, can be seen in the traced tower contexts."""

import keras
import numpy as np

import kerastower as kt
from jax_helpers import TowerRecorder

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


