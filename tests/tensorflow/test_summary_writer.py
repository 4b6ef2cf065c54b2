"""Monitors on TensorFlow only: the default tf.summary writer.
(The monitors both backends share are tested in tests/shared/test_monitors.py.)"""

import os

import keras
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

from tests.tensorflow.helpers import id_data, mlp


def _endless(n=32, batch=4):
    x, y = id_data(n)
    x[:, 0] = 0.0
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()


def _scalar_steps(logdir, tag):
    accumulator = event_accumulator.EventAccumulator(os.path.join(logdir, "train"))
    accumulator.Reload()
    return [e.step for e in accumulator.Tensors(tag)]


def test_a_failed_run_leaves_no_default_summary_writer_behind(two_towers, tmp_path):
    class Fail(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise RuntimeError("killed")

    logdir = str(tmp_path / "run")
    with pytest.raises(RuntimeError, match="killed"):
        mlp().fit(_endless(), steps_per_epoch=2, epochs=2, verbose=0, logdir=logdir,
                  callbacks=[Fail()])
    # Else later summaries anywhere in the program would go into this run's logs.
    assert not bool(tf.summary.scalar("after_the_failed_fit", 1.0, step=0))
    assert _scalar_steps(logdir, "batch_loss") == [1, 2]
