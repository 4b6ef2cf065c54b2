"""The batch hooks fit calls: only where a callback has one of its own.

Keras's CallbackList hands every step's logs to a thread for
`on_train_batch_end` whether or not any callback has the hook; kerastower's
loop calls neither batch hook where none of the run's callbacks has one
(docs/performance.md). These tests count the CallbackList's own calls.
"""

import time

import keras
import numpy as np
import pytest

import kerastower as kt
from kerastower.errors import NonFiniteError

from tests.helpers.common import id_data
from tests.helpers.common import mlp
from tests.helpers.doctests import examples_of
from tests.helpers.doctests import run_examples

STEPS = 4  # 32 examples, 2 towers of 4

# Keras 3.15's progress bar shows each metric's last value; 3.10-3.14's
# averages the steps handed, and so gets every step.
LAST_VALUES = tuple(int(part) for part in keras.version().split(".")[:2]) >= (3, 15)


@pytest.fixture
def hook_calls(monkeypatch):
    """How many times keras's CallbackList ran each train-batch hook."""
    calls = {"on_train_batch_begin": 0, "on_train_batch_end": 0}
    for name in calls:
        original = getattr(keras.callbacks.CallbackList, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(keras.callbacks.CallbackList, name, counted)
    return calls


class EpochEnds(keras.callbacks.Callback):
    """A callback with an epoch hook only."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_epoch_end(self, epoch, logs=None):
        self.losses.append(logs["loss"])


def _fit(callbacks, epochs=2, model=None):
    model = model or mlp()
    x, y = id_data(32)
    return model, model.fit(x, y, batch_size=4, epochs=epochs, verbose=0, callbacks=callbacks)


def test_no_batch_hook_is_called_where_no_callback_has_one(two_towers, hook_calls):
    epoch_ends = EpochEnds()
    _, history = _fit([epoch_ends])
    assert hook_calls == {"on_train_batch_begin": 0, "on_train_batch_end": 0}
    # The epochs still ran, and their callbacks saw their logs.
    assert len(epoch_ends.losses) == 2
    np.testing.assert_allclose(epoch_ends.losses, history.history["loss"])


@pytest.mark.parametrize("hook", ["on_train_batch_end", "on_batch_end", "on_train_batch_begin",
                                  "on_batch_begin"])
def test_every_batch_hook_runs_where_a_callback_has_one(two_towers, hook_calls, hook):
    seen = []

    class OneHook(keras.callbacks.Callback):
        pass

    setattr(OneHook, hook, lambda self, batch, logs=None: seen.append(batch))
    _fit([OneHook()])
    assert hook_calls == {"on_train_batch_begin": 2 * STEPS, "on_train_batch_end": 2 * STEPS}
    assert seen == list(range(STEPS)) * 2


def test_a_hook_set_on_the_instance_runs(two_towers, hook_calls):
    seen = []
    _fit([keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(batch))])
    assert seen == list(range(STEPS)) * 2
    assert hook_calls["on_train_batch_end"] == 2 * STEPS


def test_a_kerastower_callback_gets_every_step(two_towers, hook_calls):
    class Steps(kt.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.steps = []

        def _trigger_step(self):
            self.steps.append(self.global_step)

    steps = Steps()
    _fit([steps])
    assert steps.steps == list(range(1, 2 * STEPS + 1))
    assert hook_calls["on_train_batch_end"] == 2 * STEPS


def test_a_callback_list_of_the_users_own_class_gets_every_hook(two_towers):
    class Counting(keras.callbacks.CallbackList):
        ends = 0

        def on_train_batch_end(self, batch, logs=None):
            Counting.ends += 1
            super().on_train_batch_end(batch, logs)

    model = mlp()
    _fit(Counting([EpochEnds()], add_history=True, model=model), model=model)
    assert Counting.ends == 2 * STEPS


def test_a_hook_a_callback_sets_when_training_begins_runs(two_towers):
    class HookedLater(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_train_begin(self, logs=None):
            self.on_train_batch_end = lambda batch, logs=None: self.seen.append(batch)

    later = HookedLater()
    _fit([later])
    assert later.seen == list(range(STEPS)) * 2


def test_a_callback_added_to_the_list_when_training_begins_gets_every_step(two_towers):
    seen = []

    class AddsOne(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            hooked = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(batch))
            hooked.set_model(self.model)
            callback_list.callbacks.append(hooked)

    model = mlp()
    callback_list = keras.callbacks.CallbackList([AddsOne()], add_history=True, model=model)
    _fit(callback_list, model=model)
    assert seen == list(range(STEPS)) * 2


@pytest.mark.parametrize("added", ["hook", "callback"])
def test_a_reader_that_appears_when_training_begins_never_sees_a_step_that_was_not_applied(two_towers, added):
    """Where no callback reads a step when fit starts, JAX's calls may come
    back before their finite flags are read; a hook (or a callback) that
    appears in on_train_begin must still see only applied steps, each once,
    all seen when fit raises (Keras's list runs them in a thread here)."""
    seen = []

    def slowly_seen(batch):
        time.sleep(0.05)
        seen.append(batch)

    class Appears(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            if added == "hook":
                self.on_train_batch_end = lambda batch, logs=None: slowly_seen(batch)
            else:
                hooked = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: slowly_seen(batch))
                hooked.set_model(self.model)
                callback_list.callbacks.append(hooked)

    model = mlp()
    callback_list = keras.callbacks.CallbackList([Appears()], add_history=True, model=model)
    x, _ = id_data(32)
    x[17, 1] = np.nan  # the third step's (2 towers of 4 a step: examples 16-23)
    _, y = id_data(32)
    with pytest.raises(NonFiniteError):
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=callback_list)
    assert sorted(seen) == [0, 1]
    assert model.loop.global_step == 2


def _recorded_bar_steps(monkeypatch):
    """(the steps kerastower's ProgressBar was handed, each `shows` answer)."""
    from kerastower.callbacks.monitors import ProgressBar

    handed, answers = [], []
    shows, on_end = ProgressBar.shows, ProgressBar.on_train_batch_end

    def recorded_shows(self, step):
        answers.append((step, shows(self, step)))
        return answers[-1][1]

    def recorded_end(self, batch, logs=None):
        handed.append(batch)
        return on_end(self, batch, logs)

    monkeypatch.setattr(ProgressBar, "shows", recorded_shows)
    monkeypatch.setattr(ProgressBar, "on_train_batch_end", recorded_end)
    return handed, answers


@pytest.mark.skipif(not LAST_VALUES, reason="Keras before 3.15 averages the bar's steps")
@pytest.mark.parametrize("verbose", [1, 2])
def test_the_progress_bar_alone_is_handed_the_steps_it_may_draw_and_each_epochs_last(
        two_towers, hook_calls, monkeypatch, capsys, verbose):
    """Where kerastower's progress bar is the only callback with a batch
    hook (fit's default), the loop hands it the steps its `shows` says it
    may draw, and each epoch's last, which its count ends at; no
    on_train_batch_begin (the bar has none)."""
    handed, answers = _recorded_bar_steps(monkeypatch)
    model = mlp()
    x, y = id_data(32 * 8)
    steps = 32
    model.fit(x, y, batch_size=4, epochs=2, verbose=verbose, shuffle=False)
    assert [step for step, _ in answers] == list(range(steps)) * 2
    expected = []
    for epoch in range(2):
        shown = [step for step, yes in answers[epoch * steps:(epoch + 1) * steps] if yes]
        expected += shown if shown and shown[-1] == steps - 1 else shown + [steps - 1]
    # Keras's pool of threads may run two hand-offs out of order.
    assert sorted(handed) == sorted(expected)
    assert hook_calls == {"on_train_batch_begin": 0, "on_train_batch_end": len(expected)}
    assert answers[0] == (0, True) and answers[steps] == (0, True)  # each epoch's first
    if verbose == 2:
        # The first starts the bar's time per step; it draws the epoch line only.
        assert expected == [0, steps - 1, 0, steps - 1]
    assert capsys.readouterr().out.count(f"{steps}/{steps}") >= 2


def test_a_progress_bar_that_averages_the_steps_handed_gets_every_step(two_towers, hook_calls, monkeypatch):
    """Keras 3.10-3.14's ProgbarLogger averages each metric over the steps
    it is handed: skipping steps would change what it shows."""
    from kerastower.callbacks.monitors import ProgressBar

    def averaging_progbar(self):
        if self.progbar is None:
            self.progbar = keras.utils.Progbar(target=self.target, verbose=self.verbose, unit_name="step")

    monkeypatch.setattr(ProgressBar, "_maybe_init_progbar", averaging_progbar)
    handed, answers = _recorded_bar_steps(monkeypatch)
    model = mlp()
    x, y = id_data(32)
    model.fit(x, y, batch_size=4, epochs=2, verbose=1)
    assert sorted(handed) == sorted(list(range(STEPS)) * 2)
    assert answers == []
    assert hook_calls == {"on_train_batch_begin": 2 * STEPS, "on_train_batch_end": 2 * STEPS}


def test_beside_a_callback_with_its_own_batch_hook_the_progress_bar_gets_every_step(
        two_towers, hook_calls, monkeypatch):
    handed, answers = _recorded_bar_steps(monkeypatch)
    seen = []
    model = mlp()
    x, y = id_data(32)
    model.fit(x, y, batch_size=4, epochs=2, verbose=1,
              callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(b))])
    assert seen == list(range(STEPS)) * 2
    assert sorted(handed) == sorted(list(range(STEPS)) * 2)
    assert answers == []
    assert hook_calls == {"on_train_batch_begin": 2 * STEPS, "on_train_batch_end": 2 * STEPS}


def test_batch_hooks_hand_the_steps_shown_and_the_epochs_last():
    from kerastower.loop.batch_hooks import BatchHooks

    seen = []
    callbacks = keras.callbacks.CallbackList(
        [keras.callbacks.LambdaCallback(on_train_batch_begin=lambda b, logs: seen.append(("begin", b)),
                                        on_train_batch_end=lambda b, logs: seen.append((b, logs["loss"])))])
    hooks = BatchHooks(callbacks, shows=lambda step: step % 3 == 0)
    for step in range(8):
        hooks.begin(step)
        hooks.end(step, {"loss": float(step)})
    hooks.epoch_end()
    hooks.epoch_end()  # handed once
    assert seen == [(0, 0.0), (3, 3.0), (6, 6.0), (7, 7.0)]
    every = BatchHooks(callbacks)
    seen.clear()
    every.begin(0)
    every.end(0, {"loss": 1.0})
    every.epoch_end()
    assert seen == [("begin", 0), (0, 1.0)]


def test_the_progress_bar_shows_its_first_step_then_one_each_half_interval(monkeypatch):
    from types import SimpleNamespace

    from kerastower.callbacks import monitors

    clock = [100.0]
    monkeypatch.setattr(monitors, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    bar = monitors.ProgressBar()
    bar.set_params({"epochs": 1, "steps": 100, "verbose": 1})
    bar.training_run = type("Run", (), {"state": kt.LoopState()})()
    bar.on_train_begin()
    bar.on_epoch_begin(0)
    assert bar.shows_last_values() is LAST_VALUES
    bar.progbar.interval = 0.2
    assert [bar.shows(0), bar.shows(1), bar.shows(2)] == [True, False, False]
    clock[0] += 0.099
    assert bar.shows(3) is False
    clock[0] += 0.002
    assert [bar.shows(4), bar.shows(5)] == [True, False]
    bar.on_epoch_begin(1)
    assert bar.shows(0) is True  # a new epoch's first
    quiet = monitors.ProgressBar()
    quiet.set_params({"epochs": 1, "steps": 100, "verbose": 2})
    quiet.training_run = bar.training_run
    quiet.on_epoch_begin(0)
    clock[0] += 10
    assert [quiet.shows(0), quiet.shows(1), quiet.shows(2)] == [True, False, False]


def test_the_modules_example_runs(tmp_path):
    """pytest does not collect module doctests in this project: run it here."""
    from kerastower.loop import batch_hooks

    tests = examples_of(batch_hooks)
    assert tests
    failures = run_examples(tests, tmp_path)
    assert not failures, failures[-3000:]
