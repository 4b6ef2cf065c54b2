"""kt.Trainer's run on both backends: its callbacks see the trainer's loop."""

import os
import sys

import keras

import kerastower as kt

from shared_helpers import tower_devices

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from loop_cases import OneStepTrainer  # noqa: E402


def test_trainer_logdir_and_loop_state_reach_the_callbacks(tmp_path):
    """Callbacks are set up with the trainer's LoopState (they used to get
    the model's fit LoopState: MinSaver found no folder in `logdir`, and a
    callback keeping `model.loop` saw step 0 throughout)."""
    with kt.distributed("mirrored", devices=tower_devices(2)):
        trainer = OneStepTrainer()
    saver = kt.callbacks.MinSaver("loss")  # no folder of its own: the run's logdir
    kept = []

    class KeepsTheLoop(keras.callbacks.Callback):
        def set_model(self, model):
            super().set_model(model)
            self.loop = model.loop

        def on_train_batch_end(self, batch, logs=None):
            kept.append(self.loop.global_step)

    trainer.train(callbacks=[saver, KeepsTheLoop()], steps_per_epoch=2, max_epoch=2,
                  verbose=0, logdir=str(tmp_path))
    assert os.path.exists(os.path.join(tmp_path, saver.filename + ".keras"))
    assert kept == [1, 2, 3, 4]
    assert trainer.loop.logdir == str(tmp_path)
