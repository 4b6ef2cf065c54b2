"""kt.Trainer on both backends: the loop around run_step(), its hooks and
counters, stopping and failing, and the same hooks as fit's in the same
order; a trainer without a model checkpoints and resumes.
(Tower functions and inputs, whose input types differ by backend, are in
tests/tensorflow/test_tf_trainers.py and tests/jax/test_jax_trainers.py.)"""

import itertools

import keras
import numpy as np
import pytest

import kerastower as kt
from kerastower import backend as kt_backend

from tests.helpers.common import tower_devices

from tests.helpers.loop_cases import EventLog
from tests.helpers.loop_cases import Hooks
from tests.helpers.loop_cases import check_counter_checkpoints_and_resumes
from tests.helpers.loop_cases import check_trainer_hooks_match
from tests.helpers.loop_cases import keras_recorder


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(1234)
    yield


class Counter(kt.TowerModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.total = self.add_weight(shape=(), initializer="zeros", trainable=False)


class KerasLog(keras.callbacks.Callback):
    def __init__(self, events):
        super().__init__()
        self.events = events

    def on_train_begin(self, logs=None):
        self.events.append(("on_train_begin",))

    def on_epoch_begin(self, epoch, logs=None):
        self.events.append(("on_epoch_begin", epoch))

    def on_train_batch_begin(self, batch, logs=None):
        self.events.append(("on_train_batch_begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.events.append(("on_train_batch_end", batch, dict(logs)))

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(("on_epoch_end", epoch, dict(logs)))

    def on_train_end(self, logs=None):
        self.events.append(("on_train_end",))


class TwoCallsTrainer(kt.Trainer):
    """Each step: one hooked run, one plain call; raises when told to."""

    def __init__(self, model, stop_at=None, fail_at=None):
        super().__init__(model)
        self.stop_at, self.fail_at = stop_at, fail_at
        self.plain_calls = 0
        self.seen = []

    def value(self):
        return {"value": float(self.global_step)}

    def run_step(self):
        self.seen.append((self.epoch_num, self.local_step, self.global_step))
        if self.global_step == self.stop_at:
            raise kt.StopTraining("enough")
        if self.global_step == self.fail_at:
            raise ValueError("broken step")
        self.hooked_run(self.value)
        self.plain_calls += 1


def expected_events(epochs, steps, stopped_at=None):
    events = [("before_train", 0, 0, 0)]
    step = 0
    for epoch in range(1, epochs + 1):
        events.append(("before_epoch", epoch, 0, step))
        for local in range(steps):
            if step == stopped_at:
                return events + [("after_train", epoch, local, step)]
            events += [
                ("before_run", epoch, local, step),
                ("after_run", epoch, local, step, float(step)),
                ("trigger_step", epoch, local + 1, step + 1),
            ]
            step += 1
        events += [("after_epoch", epoch, steps, step), ("trigger_epoch", epoch, steps, step)]
    return events + [("after_train", epochs, steps, step)]


def test_loop_calls_hooks_in_order_and_counts():
    events, keras_events = [], []
    trainer = TwoCallsTrainer(Counter())
    history = trainer.train(
        [EventLog(events), KerasLog(keras_events)], steps_per_epoch=3, max_epoch=2, verbose=0
    )
    assert events == expected_events(2, 3)
    # The plain call ran as often as the hooked one but triggered no hook.
    assert trainer.plain_calls == 6 and sum(e[0] == "after_run" for e in events) == 6
    assert trainer.seen == [(e, s, 3 * (e - 1) + s) for e in (1, 2) for s in range(3)]
    assert (trainer.global_step, trainer.epoch_num, trainer.local_step) == (6, 2, 3)
    expected_keras = [("on_train_begin",)]
    for epoch in range(2):
        expected_keras.append(("on_epoch_begin", epoch))
        for step in range(3):
            expected_keras += [
                ("on_train_batch_begin", step),
                ("on_train_batch_end", step, {"value": float(3 * epoch + step)}),
            ]
        # Epoch logs: the mean of each value over the epoch's steps.
        expected_keras.append(("on_epoch_end", epoch, {"value": 3 * epoch + 1.0}))
    assert keras_events == expected_keras + [("on_train_end",)]
    assert history.history == {"value": [1.0, 4.0]}


def test_fit_makes_each_step_function_call_a_hooked_run(two_towers):
    runs = []

    class Runs(kt.callbacks.Callback):
        def _before_run(self):
            runs.append(("before", self.global_step))

        def _after_run(self, outputs):
            runs.append(("after", self.global_step, None if outputs is None else sorted(outputs)))

    inputs = keras.Input((2,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    x = np.ones((48, 2), "float32")
    model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0, callbacks=[Runs()])
    # 48 examples / (2 towers x 4) = 6 steps, run 2 per call; a pass of known
    # length ends after its last step, with no call left to find no data (as
    # Keras). As under kt.Trainer, global_step counts the steps finished
    # before the run.
    assert runs == [r for step in (0, 2, 4) for r in (("before", step), ("after", step, ["loss"]))]


def test_training_continues_from_its_global_step_and_starting_epoch():
    events = []
    trainer = TwoCallsTrainer(Counter())
    trainer.train([EventLog(events)], steps_per_epoch=2, max_epoch=1, verbose=0)
    trainer.train([EventLog(events)], steps_per_epoch=2, starting_epoch=2, max_epoch=3, verbose=0)
    assert trainer.seen == [(1, 0, 0), (1, 1, 1), (2, 0, 2), (2, 1, 3), (3, 0, 4), (3, 1, 5)]


def test_stop_training_from_run_step_ends_cleanly():
    events = []
    trainer = TwoCallsTrainer(Counter(), stop_at=4)
    trainer.train([EventLog(events)], steps_per_epoch=3, max_epoch=5, verbose=0)
    assert events == expected_events(5, 3, stopped_at=4)
    assert trainer.global_step == 4


def test_stop_training_from_a_callback_ends_cleanly():
    class StopAfterEpoch2(kt.callbacks.Callback):
        def _trigger_epoch(self):
            if self.epoch_num == 2:
                raise kt.StopTraining()

    events = []
    trainer = TwoCallsTrainer(Counter())
    trainer.train([StopAfterEpoch2(), EventLog(events)], steps_per_epoch=2, max_epoch=9, verbose=0)
    assert trainer.global_step == 4
    # StopTraining from the first callback ends the loop at once: the next
    # callback gets no epoch end, only after_train.
    assert [e[0] for e in events[-3:]] == ["after_run", "trigger_step", "after_train"]


def test_a_failing_step_still_runs_after_train_and_raises():
    events = []
    trainer = TwoCallsTrainer(Counter(), fail_at=2)
    with pytest.raises(ValueError, match="broken step"):
        trainer.train([EventLog(events)], steps_per_epoch=3, max_epoch=2, verbose=0)
    assert events[-1] == ("after_train", 1, 2, 2)
    assert trainer.model.loop is not trainer.loop  # the model's fit loop is back


def test_keras_early_stopping_stops_the_trainer():
    class RisingLoss(kt.Trainer):
        def run_step(self):
            return {"loss": float(self.global_step)}

    trainer = RisingLoss(Counter())
    history = trainer.train(
        [keras.callbacks.EarlyStopping("loss", patience=1)], steps_per_epoch=2, max_epoch=10, verbose=0
    )
    assert history.history["loss"] == [0.5, 2.5]
    assert trainer.epoch_num == 2


def test_stop_training_from_after_train_is_clean():
    class StopLate(kt.callbacks.Callback):
        def _after_train(self):
            raise kt.StopTraining()

    trainer = TwoCallsTrainer(Counter())
    trainer.train([StopLate()], steps_per_epoch=2, verbose=0)
    assert trainer.global_step == 2


def test_subclass_constructors_leave_tower_model_alone():
    class PassesThrough(kt.TowerModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

    class TakesTwo(kt.TowerModel):
        def __init__(self, a, b, **kwargs):
            super().__init__(**kwargs)

    class ForwardsTwo(kt.TowerModel):
        def __init__(self, a, b, **kwargs):
            super().__init__(a, b, **kwargs)

    inputs = keras.Input((2,))
    outputs = keras.layers.Dense(1)(inputs)
    assert PassesThrough(inputs, outputs).outputs
    assert type(TakesTwo(1, 2)).__mro__[1] is kt.TowerModel
    with pytest.raises(TypeError, match="Name the first two parameters"):
        ForwardsTwo(inputs, outputs)
    assert kt.TowerModel.__bases__ == (kt_backend.tower_steps(), keras.Model)   # not made functional
    assert Counter().total.shape == ()


def test_a_trainers_neutral_argument_errors_say_what_to_do():
    with pytest.raises(TypeError, match="kt.TowerModel"):
        kt.Trainer(keras.Sequential([keras.layers.Dense(1)]))
    with pytest.raises(NotImplementedError, match="override run_step"):
        kt.Trainer(Counter()).train(steps_per_epoch=1, verbose=0)
    with pytest.raises(ValueError, match="steps_per_epoch must be a positive int"):
        kt.Trainer(Counter(), train_op=lambda: None).train(verbose=0)


def test_fit_and_trainer_call_the_hooks_in_the_same_order():
    fit_events = []
    devices = tower_devices(2)
    with kt.distributed("mirrored", devices=devices):
        inputs = keras.Input((2,))
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
        batch = (np.ones((4, 2), "float32"), np.ones((4, 1), "float32"))
        model.fit(itertools.repeat(batch), steps_per_epoch=3, epochs=2, verbose=0,
                  callbacks=[Hooks(fit_events), keras_recorder(fit_events)])
    check_trainer_hooks_match(fit_events, devices)


def test_a_trainer_without_a_model_checkpoints_and_resumes_its_state(tmp_path):
    check_counter_checkpoints_and_resumes(str(tmp_path / "ckpt"))


def test_a_failing_step_runs_kt_after_train_but_not_keras_on_train_end():
    events = []

    class Failing(kt.Trainer):
        def run_step(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        Failing().train(callbacks=[Hooks(events), keras_recorder(events)],
                        steps_per_epoch=2, verbose=0)
    assert events[-1][0] == "after_train"
    assert ("keras_train_end",) not in events
