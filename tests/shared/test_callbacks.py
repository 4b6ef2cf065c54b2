"""Loop state and tensorpack-style callbacks under TowerModel.fit."""

import itertools

import keras
import pytest

import kerastower as kt

from tests.helpers.common import endless
from tests.helpers.common import id_data
from tests.helpers.common import mlp
from tests.helpers.common import tower_devices


class Recording(kt.callbacks.Callback):
    """Records every template call with the loop counters at that moment."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def _note(self, what):
        self.calls.append((what, self.epoch_num, self.local_step, self.global_step))

    def _before_train(self):
        self._note("before_train")

    def _before_epoch(self):
        self._note("before_epoch")

    def _trigger_step(self):
        self._note("trigger_step")

    def _after_epoch(self):
        self._note("after_epoch")

    def _trigger(self):
        self._note("trigger")

    def _after_train(self):
        self._note("after_train")


def _repeating(n=32, batch=4):
    x, y = id_data(n)
    return endless(x, y, batch)


def test_template_methods_run_in_order_with_the_loop_counters(two_towers):
    model = mlp()
    recording = Recording()
    model.fit(_repeating(), steps_per_epoch=3, epochs=2, verbose=0, callbacks=[recording])
    expected = [("before_train", 0, 0, 0)]
    for epoch in (1, 2):
        base = 3 * (epoch - 1)
        expected.append(("before_epoch", epoch, 0, base))
        expected += [("trigger_step", epoch, s, base + s) for s in (1, 2, 3)]
        expected += [("after_epoch", epoch, 3, base + 3), ("trigger", epoch, 3, base + 3)]
    expected.append(("after_train", 2, 3, 6))
    assert recording.calls == expected


def test_loop_state_continues_across_fit_calls(two_towers):
    model = mlp()
    data = _repeating()
    model.fit(data, steps_per_epoch=4, epochs=2, verbose=0)
    assert (model.loop.epoch_num, model.loop.global_step) == (2, 8)
    recording = Recording()
    model.fit(data, steps_per_epoch=4, epochs=3, initial_epoch=2, verbose=0, callbacks=[recording])
    loop = model.loop
    assert (loop.starting_epoch, loop.max_epoch, loop.steps_per_epoch) == (3, 3, 4)
    assert recording.calls[1] == ("before_epoch", 3, 0, 8)
    assert recording.calls[-1] == ("after_train", 3, 4, 12)


def test_steps_per_epoch_is_known_for_finite_data(two_towers):
    x, y = id_data(40)
    model = mlp()
    model.fit(x, y, batch_size=4, verbose=0)  # 10 batches over 2 towers
    assert model.loop.steps_per_epoch == 5 and model.loop.local_step == 5


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_periodic_trigger_every_k_steps_and_epochs(two_towers, steps_per_execution):
    model = mlp(steps_per_execution=steps_per_execution)
    every_2_steps, every_2_epochs = Recording(), Recording()
    callbacks = [
        kt.callbacks.PeriodicTrigger(every_2_steps, every_k_steps=2),
        kt.callbacks.PeriodicTrigger(every_2_epochs, every_k_epochs=2),
    ]
    model.fit(_repeating(), steps_per_epoch=6, epochs=4, verbose=0, callbacks=callbacks)
    step_triggers = [c[3] for c in every_2_steps.calls if c[0] == "trigger"]
    if steps_per_execution == 1:
        assert step_triggers == list(range(2, 25, 2))
    else:  # the hook runs at steps 3, 6, 9, ...: each crossing of a multiple of 2 fires once
        assert step_triggers == [3, 6, 9, 12, 15, 18, 21, 24]
    epoch_triggers = [c[1] for c in every_2_epochs.calls if c[0] == "trigger"]
    assert epoch_triggers == [2, 4]
    # The wrapped callbacks' other hooks still ran every time.
    assert [c[0] for c in every_2_epochs.calls].count("before_epoch") == 4


def test_enable_callback_if(two_towers):
    model = mlp()
    recording = Recording()
    late = kt.callbacks.EnableCallbackIf(recording, lambda cb: cb.epoch_num >= 3)
    model.fit(_repeating(), steps_per_epoch=2, epochs=3, verbose=0, callbacks=[late])
    # As in tensorpack, set-up and tear-down run whatever pred says; the
    # hooks of epochs, steps and runs only while it is true.
    assert recording.calls[0] == ("before_train", 0, 0, 0)
    assert {c[1] for c in recording.calls[1:]} == {3}
    assert [c[0] for c in recording.calls[1:]] == [
        "before_epoch", "trigger_step", "trigger_step", "after_epoch", "trigger", "after_train"]


def test_enable_callback_if_runs_before_and_after_run_as_a_pair(two_towers):
    class Runs(kt.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.calls = []

        def _before_run(self):
            self.calls.append("before_run")

        def _after_run(self, outputs):
            self.calls.append("after_run")

    flips = itertools.cycle([True, False])  # pred changes at every look
    runs = Runs()
    model = mlp()
    model.fit(_repeating(), steps_per_epoch=4, epochs=1, verbose=0,
              callbacks=[kt.callbacks.EnableCallbackIf(runs, lambda cb: next(flips))])
    # The run hooks ran (in steps 1 and 3, where the look before the run
    # said True) or not, both together.
    assert runs.calls == ["before_run", "after_run"] * 2


def test_template_methods_read_and_extend_the_logs_of_the_running_hook(two_towers):
    class Doubler(kt.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.step_keys = []

        def _trigger_step(self):
            self.step_keys.append(sorted(self.logs))

        def _trigger(self):  # at the epoch end: the epoch logs, seen by later callbacks
            self.logs["twice_loss"] = 2 * self.logs["loss"]

    model = mlp()
    doubler = Doubler()
    history = model.fit(_repeating(), steps_per_epoch=2, epochs=2, verbose=0, callbacks=[doubler])
    assert doubler.step_keys == [["accuracy", "loss"]] * 4
    assert history.history["twice_loss"] == pytest.approx([2 * v for v in history.history["loss"]])


def test_keras_and_kerastower_callbacks_mix_in_one_list(two_towers):
    model = mlp()
    recording = Recording()
    seen_epochs = []
    keras_callback = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen_epochs.append((epoch, sorted(logs))))
    history = model.fit(_repeating(), steps_per_epoch=2, epochs=2, verbose=0,
                        callbacks=[keras_callback, recording])
    assert seen_epochs == [(0, ["accuracy", "loss"]), (1, ["accuracy", "loss"])]
    assert len(history.history["loss"]) == 2
    assert recording.calls[-1][0] == "after_train"


def test_triggers_reject_bad_arguments():
    with pytest.raises(ValueError, match="every_k_steps must be a positive int; got 0"):
        kt.callbacks.PeriodicTrigger(Recording(), every_k_steps=0)
    with pytest.raises(ValueError, match="needs every_k_steps or every_k_epochs"):
        kt.callbacks.PeriodicTrigger(Recording())
    with pytest.raises(TypeError, match="wraps a kt.callbacks.Callback or a keras.callbacks.Callback; got str"):
        kt.callbacks.PeriodicTrigger("ModelSaver", every_k_epochs=1)
    assert Recording().chief_only is True


def test_chief_only_callbacks_do_not_run_on_other_processes(monkeypatch):
    """A strategy whose process is not the chief (as a Horovod rank > 0, or
    a JAX process other than 0, will be) runs the callbacks that are not
    chief_only, and Keras's."""
    with kt.distributed("mirrored", devices=tower_devices(2)) as strategy:
        # The strategy's class (TFDistributeStrategy, JaxTowerStrategy), for this test only.
        monkeypatch.setattr(type(strategy), "is_chief", property(lambda self: False))
        assert not strategy.is_chief
        model = mlp()
        chief_only, everywhere = Recording(), Recording()
        everywhere.chief_only = False
        keras_seen = []
        keras_callback = keras.callbacks.LambdaCallback(
            on_epoch_end=lambda e, logs: keras_seen.append(e))
        model.fit(_repeating(), steps_per_epoch=2, epochs=1, verbose=0,
                  callbacks=[chief_only, everywhere, keras_callback])
    assert chief_only.calls == []
    assert everywhere.calls[-1][0] == "after_train"
    assert keras_seen == [0]
