"""kt.Trainer's run on both backends: its callbacks see the trainer's loop."""

import os

import keras
import numpy as np

import kerastower as kt

from tests.helpers.common import tower_devices

from tests.helpers.loop_cases import OneStepTrainer


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


class _WatchTheRun(kt.callbacks.Callback):
    """Records, when training begins, what the run hands its callbacks."""

    def __init__(self):
        super().__init__()
        self.seen = None

    def _before_train(self):
        run = self.training_run
        model = run.model
        self.seen = {
            "run": run,
            "model points at the run": model.training_run is run,
            "model.loop is the run's state": model.loop is run.state,
            "engine": run.engine is model.engine,
            "counters": (self.global_step, self.epoch_num) == (run.state.global_step, run.state.epoch_num),
        }


def test_the_training_run_owns_the_loop_state_and_the_trainer_leaves_the_model_alone():
    """kt.Trainer used to swap `model.loop` for its own during train(); now
    the loop trains through a TrainingRun that owns the state, hands itself
    to every callback (wrapped ones too), and the model only points at the
    run that trains it."""
    with kt.distributed("mirrored", devices=tower_devices(2)):
        trainer = OneStepTrainer()
    model = trainer.model
    fit_loop = model.loop
    watch = _WatchTheRun()
    trainer.train(callbacks=[kt.callbacks.PeriodicTrigger(watch, every_k_epochs=1)],
                  steps_per_epoch=2, max_epoch=2, verbose=0)
    run = watch.seen.pop("run")
    assert all(watch.seen.values()), watch.seen
    assert run.state is trainer.loop and run.name == "OneStepTrainer"
    assert run.state.global_step == 4
    assert model.training_run is None and model.loop is fit_loop
    assert fit_loop.global_step == 0
    assert "loop" not in vars(model)  # nothing assigned the model's loop


def test_fit_trains_through_a_run_whose_state_is_the_models_own():
    with kt.distributed("mirrored", devices=tower_devices(2)):
        inputs = keras.Input((3,))
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    watch = _WatchTheRun()
    x, y = np.ones((16, 3), "float32"), np.ones((16, 1), "float32")
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[watch])
    run = watch.seen.pop("run")
    assert all(watch.seen.values()), watch.seen
    assert run.name == "fit" and run.state is model.loop
    assert model.training_run is None and model.loop.global_step == 4
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert model.loop.global_step == 6  # fit's counters go on across calls
