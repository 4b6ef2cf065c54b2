"""The exceptions a step's Python input raises reach the user, chained.

A Python generator or keras.utils.PyDataset feeding the TensorFlow steps
raises in tf.data's thread, which passes on only the text; the engine's
record of the run's failures (`model.engine.failures`, a StepFailures) keeps
the exception, and the step that fails names it, its tower and its batch.
"""

import keras
import numpy as np
import pytest

import kerastower as kt
from kerastower.inputs.step_failures import StepFailures
from kerastower.errors import StepFailedError


class BadRecord(Exception):
    """The user's own error type, which must reach them."""


def _model():
    inputs = keras.Input((4,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _batches(raise_at, n=12):
    """Batches of 4 examples; batch `raise_at` (0-based) raises instead."""
    rng = np.random.default_rng(0)
    for index in range(n):
        if index == raise_at:
            raise BadRecord(f"record {4 * index} is corrupt")
        x = rng.normal(size=(4, 4)).astype("float32")
        yield x, x.sum(axis=1, keepdims=True)


class RaisingBatches(keras.utils.PyDataset):
    """Six batches of 4 examples; batch `raise_at` raises (the first two
    are read for the input's signature)."""

    def __init__(self, raise_at, **kwargs):
        super().__init__(**kwargs)
        self.raise_at = raise_at

    def __len__(self):
        return 6

    def __getitem__(self, index):
        if index == self.raise_at:
            raise BadRecord(f"batch {index} is corrupt")
        x = np.full((4, 4), index, "float32")
        return x, x.sum(axis=1, keepdims=True)


def test_a_python_generator_exception_names_the_step_and_is_the_cause():
    with kt.distributed("single"):
        model = _model()
    # Batch 2 (0-based; examples 8 to 11) is step 3's on one tower.
    with pytest.raises(StepFailedError, match=r"^Training step 3 failed on tower 0: the generator of "
                                              r"The input \(generator\) raised BadRecord: record 8 is "
                                              r"corrupt \(making batch 2 of the pass, counted from 0: "
                                              r"tower 0's batch of step 3 of the pass") as caught:
        model.fit(_batches(raise_at=2), epochs=1, verbose=0)
    assert isinstance(caught.value.__cause__, BadRecord)
    assert model.loop.global_step == 2
    assert isinstance(model.engine.failures, StepFailures)
    assert model.engine.failures.generator_errors == []   # taken by the failed step


def test_a_pydataset_exception_in_evaluate_and_predict_is_the_cause(two_towers):
    model = _model()
    # Batch 3 is tower 1's of step 2, but the tower whose pipeline reads it
    # first meets its error, and which does is a race.
    with pytest.raises(StepFailedError, match=r"^Evaluation step \d failed on tower \d: the generator of "
                                              r"The input \(RaisingBatches\) raised BadRecord: batch 3") as caught:
        model.evaluate(RaisingBatches(raise_at=3), verbose=0)
    assert isinstance(caught.value.__cause__, BadRecord)
    with pytest.raises(StepFailedError, match=r"^Prediction step \d failed on tower \d: .*BadRecord: batch 3") as caught:
        model.predict(RaisingBatches(raise_at=3), verbose=0)
    assert isinstance(caught.value.__cause__, BadRecord)
