"""GeneratorInput's feed (kerastower/inputs/python_feed.py): a thread runs the
generator ahead; items arrive whole and in order, a wrong item is named, and
nothing is left running after fit."""

import gc
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerastower as kt
from tests.tensorflow.helpers import Recorder, mlp
from kerastower.errors import InputSourceError
from kerastower.errors import StepFailedError

SIGNATURE = (tf.TensorSpec((None, 4), tf.float32), tf.TensorSpec((None,), tf.int32))


def _feed_threads():
    return [t for t in threading.enumerate() if t.name.startswith("kerastower-feed")]


def _wait_for(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    return condition()


def _id_batches(count, closed=None):
    def batches():
        try:
            for i in range(count):
                yield np.full((2, 4), i, "float32"), np.zeros((2,), "int32")
        finally:
            if closed is not None:
                closed.append(True)

    return batches


def _taken(recorder):
    seen = {k[1]: v for k, v in recorder.seen.items() if k[3]}
    return sorted(batch[0] for batches in seen.values() for batch in batches)


def test_an_endless_generator_left_by_fit_is_closed_and_its_thread_ends(two_towers):
    closed = []
    model = mlp()
    model.fit(kt.GeneratorInput(_id_batches(10**9, closed), SIGNATURE),
              steps_per_epoch=3, epochs=2, verbose=0)
    # The iterator is gone with fit: tf.data closes the generator, as
    # from_generator does, and the thread that ran it ends.
    assert _wait_for(lambda: closed and not _feed_threads()), (closed, _feed_threads())


@pytest.mark.parametrize("prefetch", [0, 4])
def test_a_run_stops_its_feeds_even_when_an_iterator_is_still_held(prefetch):
    # Whoever keeps an iterator (a traceback, a cache), the generator is
    # closed and the thread ends when the run that made it ends.
    closed = []
    source = kt.GeneratorInput(_id_batches(10**9, closed), SIGNATURE, prefetch=prefetch)
    with source.reading():
        held = iter(source.tower_dataset(kt.TowerInputContext(0, 1)))
        first = next(held)
        assert not closed
    assert _wait_for(lambda: closed and not _feed_threads()), (closed, _feed_threads())
    assert first[0].numpy()[0, 0] == 0
    # The held iterator of the ended run ends (after what tf.data had read
    # ahead), where its generator would go on for 10**9 items; a new run
    # reads afresh.
    assert len(list(held)) < 100
    with source.reading():
        again = next(iter(source.tower_dataset(kt.TowerInputContext(0, 1))))
    assert again[0].numpy()[0, 0] == 0


def test_a_generator_whose_close_raises_is_reported_and_fit_still_ends_well():
    def batches():
        try:
            while True:
                yield np.zeros((2, 4), "float32"), np.zeros((2,), "int32")
        finally:
            raise OSError("the socket was gone")

    model = mlp()
    with pytest.warns(RuntimeWarning, match=r"closing .* raised OSError: the socket was gone"):
        history = model.fit(kt.GeneratorInput(batches, SIGNATURE, prefetch=0),
                            steps_per_epoch=2, epochs=1, verbose=0)
    assert len(history.history["loss"]) == 1


class _EvaluateTheSameSource(keras.callbacks.Callback):
    def __init__(self, source):
        super().__init__()
        self.source = source
        self.evaluations = 0

    def on_train_batch_end(self, batch, logs=None):
        self.model.evaluate(self.source, steps=1, verbose=0)
        self.evaluations += 1


def test_an_evaluate_inside_fit_stops_its_own_feeds_not_fits(two_towers):
    recorder = Recorder()
    model = mlp(recorder)
    source = kt.GeneratorInput(_id_batches(10**9), SIGNATURE)
    evaluating = _EvaluateTheSameSource(source)
    model.fit(source, steps_per_epoch=3, epochs=2, verbose=0, callbacks=[evaluating])
    assert evaluating.evaluations == 6
    # fit's iterator goes on through both epochs: items 0..11, two a step.
    assert _taken(recorder) == list(range(12))
    assert _wait_for(lambda: not _feed_threads()), _feed_threads()


@pytest.mark.parametrize("prefetch", [0, 1, 4])
def test_every_item_reaches_a_tower_once_in_order_whatever_the_prefetch(two_towers, prefetch):
    recorder = Recorder()
    model = mlp(recorder)
    model.fit(kt.GeneratorInput(_id_batches(12), SIGNATURE, prefetch=prefetch), epochs=2, verbose=0)
    assert _taken(recorder) == sorted(list(range(12)) * 2)
    assert _wait_for(lambda: not _feed_threads())


def test_an_item_that_does_not_match_the_signature_is_named(two_towers):
    def batches():
        yield np.zeros((2, 4), "float32"), np.zeros((2,), "int32")
        yield np.zeros((2, 4), "float32"), np.zeros((2,), "int32")
        yield np.zeros((2, 5), "float32"), np.zeros((2,), "int32")

    model = mlp()
    with pytest.raises(StepFailedError, match=r"Training step 2 failed on tower 0") as caught:
        model.fit(kt.GeneratorInput(batches, SIGNATURE), epochs=1, verbose=0)
    cause = caught.value.__cause__
    assert isinstance(cause, InputSourceError)
    assert "as item 3, an array of shape (2, 5)" in str(cause) and "(None, 4)" in str(cause)
    assert model.loop.global_step == 1


def test_an_item_of_the_wrong_structure_is_named():
    source = kt.GeneratorInput(lambda: iter([(np.zeros((2, 4), "float32"),)]), SIGNATURE)
    dataset = source.tower_dataset(kt.TowerInputContext(0, 1))
    with pytest.raises(tf.errors.OpError, match=r"as item 1, an item of structure"):
        list(dataset)


def test_items_convert_to_the_signature_dtype_as_from_generator_did():
    def items():
        yield {"x": [[1.5, 2.5]], "y": np.array([3], "int64")}

    signature = {"x": tf.TensorSpec((None, 2), tf.float32), "y": tf.TensorSpec((None,), tf.int32)}
    (item,) = list(kt.GeneratorInput(items, signature).tower_dataset(kt.TowerInputContext(0, 1)))
    assert item["x"].dtype == tf.float32 and item["y"].dtype == tf.int32
    np.testing.assert_array_equal(item["x"].numpy(), [[1.5, 2.5]])
    np.testing.assert_array_equal(item["y"].numpy(), [3])


def test_string_and_ragged_items_still_go_through_from_generator():
    def items():
        yield tf.ragged.constant([[1, 2], [3]]), np.array([b"a", b"b"])

    signature = (tf.RaggedTensorSpec((None, None), tf.int32), tf.TensorSpec((None,), tf.string))
    (item,) = list(kt.GeneratorInput(items, signature).tower_dataset(kt.TowerInputContext(0, 1)))
    assert item[0].to_list() == [[1, 2], [3]] and item[1].numpy().tolist() == [b"a", b"b"]
