"""Wrapped callbacks do all their work, at the periods their wrapper chooses.

`PeriodicTrigger` and `EnableCallbackIf` schedule the wrapped callback's
trigger; whatever it does when triggered (adding results to the logs,
saving, writing records) must happen then, for kt and Keras callbacks alike.
"""

import csv
import json
import os

import keras
import pytest

import kerastower as kt

from tests.helpers.common import endless
from tests.helpers.common import id_data
from tests.helpers.common import mlp


def _endless(n=32, batch=4):
    x, y = id_data(n)
    x[:, 0] = 0.0
    return endless(x, y, batch)


def _validation():
    x, y = id_data(20, seed=3)
    x[:, 0] = 0.0
    return x, y


class EpochLogs(keras.callbacks.Callback):
    """Records the keys of every epoch's logs, as callbacks after the wrapper see them."""

    def __init__(self):
        super().__init__()
        self.keys = {}

    def on_epoch_end(self, epoch, logs=None):
        self.keys[epoch + 1] = sorted(logs)


def test_periodic_inference_runner_adds_its_results_at_its_epochs_only(two_towers):
    model = mlp()
    val_x, val_y = _validation()
    runner = kt.callbacks.InferenceRunner(
        (val_x, val_y), [kt.callbacks.ScalarStats(["loss", "accuracy"]),
                         kt.callbacks.ClassificationError()], batch_size=5)
    seen = EpochLogs()
    history = model.fit(_endless(), steps_per_epoch=2, epochs=4, verbose=0,
                        callbacks=[kt.callbacks.PeriodicTrigger(runner, every_k_epochs=2), seen])
    validated = {epoch for epoch, keys in seen.keys.items() if "val_loss" in keys}
    assert validated == {2, 4}
    assert {"val_accuracy", "val_error"} <= set(seen.keys[4])
    # History got them too; the last is the final model's evaluation.
    assert len(history.history["val_loss"]) == 2
    final = model.evaluate(val_x, val_y, verbose=0, return_dict=True)
    assert history.history["val_loss"][-1] == pytest.approx(final["loss"], abs=1e-6)
    assert history.history["val_error"][-1] == pytest.approx(1 - final["accuracy"], abs=1e-6)


def test_periodic_min_saver_saves_at_its_epochs(two_towers, tmp_path):
    model = mlp()
    saver = kt.callbacks.MinSaver("loss", checkpoint_dir=str(tmp_path))
    history = model.fit(_endless(), steps_per_epoch=2, epochs=3, verbose=0,
                        callbacks=[kt.callbacks.PeriodicTrigger(saver, every_k_epochs=2)])
    assert os.path.exists(saver.path)
    # Only epoch 2 was seen, although epoch 3's loss is lower.
    losses = history.history["loss"]
    assert losses[2] < losses[1] and saver.best == pytest.approx(losses[1])


def test_enable_callback_if_writes_stats_json_only_while_enabled(two_towers, tmp_path):
    model = mlp()
    logdir = str(tmp_path / "not_made_yet")
    writer = kt.callbacks.EnableCallbackIf(kt.callbacks.JSONWriter(logdir),
                                           lambda cb: cb.epoch_num >= 3)
    history = model.fit(_endless(), steps_per_epoch=2, epochs=4, verbose=0, callbacks=[writer])
    with open(os.path.join(logdir, "stats.json")) as f:
        records = json.load(f)
    assert [(r["epoch_num"], r["global_step"]) for r in records] == [(3, 6), (4, 8)]
    assert [r["loss"] for r in records] == pytest.approx(history.history["loss"][2:])


def test_wrapped_monitors_and_param_setters_work_at_their_periods(two_towers, capsys):
    model = mlp(optimizer=keras.optimizers.SGD(0.0))  # the loss stalls
    model.knob = keras.Variable(0.0, trainable=False, name="knob")
    every_2 = lambda cb: kt.callbacks.PeriodicTrigger(cb, every_k_epochs=2)  # noqa: E731
    seen = EpochLogs()
    model.fit(_endless(), steps_per_epoch=2, epochs=4, verbose=0, callbacks=[
        every_2(kt.callbacks.ThroughputTracker()),
        every_2(kt.callbacks.ScalarPrinter(whitelist=["loss"])),
        every_2(kt.callbacks.StatMonitorParamSetter("knob", "loss", lambda v: v + 1.0,
                                                    threshold=0.01, last_k=1)),
        seen,
    ])
    assert {e for e, keys in seen.keys.items() if "samples_per_sec" in keys} == {2, 4}
    out = capsys.readouterr().out
    assert out.count("] loss: ") == 2 and "[epoch 2, step 4] loss:" in out and "[epoch 4, step 8]" in out
    # Seen at epochs 2 and 4 only: the stall is found at the second look.
    assert float(model.knob.numpy()) == 1.0


def test_periodic_keras_model_checkpoint_saves_at_its_epochs(two_towers, tmp_path):
    model = mlp()
    path = str(tmp_path / "epoch{epoch}.weights.h5")
    checkpoint = keras.callbacks.ModelCheckpoint(path, save_weights_only=True)
    model.fit(_endless(), steps_per_epoch=2, epochs=4, verbose=0,
              callbacks=[kt.callbacks.PeriodicTrigger(checkpoint, every_k_epochs=2)])
    assert sorted(os.listdir(tmp_path)) == ["epoch2.weights.h5", "epoch4.weights.h5"]


def test_keras_csv_logger_enabled_late_and_every_k_steps(two_towers, tmp_path):
    model = mlp()
    late, steps = str(tmp_path / "late.csv"), str(tmp_path / "steps.csv")
    history = model.fit(_endless(), steps_per_epoch=2, epochs=4, verbose=0, callbacks=[
        # Disabled when training begins: it still opens its file then.
        kt.callbacks.EnableCallbackIf(keras.callbacks.CSVLogger(late),
                                      lambda cb: cb.model.loop.epoch_num >= 3),
        # Its on_epoch_end, with the step's logs, every 3 global steps.
        kt.callbacks.PeriodicTrigger(keras.callbacks.CSVLogger(steps), every_k_steps=3),
    ])
    with open(late) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [2, 3]
    assert [float(r["loss"]) for r in rows] == pytest.approx(history.history["loss"][2:])
    with open(steps) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [1, 2]  # global steps 3 (epoch 2) and 6 (epoch 3)


class KerasHooks(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []

    def on_train_begin(self, logs=None):
        self.calls.append(("train_begin",))

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(("epoch_begin", epoch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("batch_end", batch))

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch_end", epoch, sorted(logs)))

    def on_train_end(self, logs=None):
        self.calls.append(("train_end",))


def test_a_wrapped_keras_callback_gets_its_other_hooks(two_towers):
    model = mlp()
    periodic, enabled = KerasHooks(), KerasHooks()
    model.fit(_endless(), steps_per_epoch=2, epochs=3, verbose=0, callbacks=[
        kt.callbacks.PeriodicTrigger(periodic, every_k_epochs=2),
        kt.callbacks.EnableCallbackIf(enabled, lambda cb: cb.model.loop.epoch_num == 2),
    ])
    epoch_hooks = [("epoch_begin", e) for e in range(3)]
    assert [c for c in periodic.calls if c[0] == "epoch_begin"] == epoch_hooks
    assert [c for c in periodic.calls if c[0] == "batch_end"] == [("batch_end", b) for b in (0, 1) * 3]
    assert [c for c in periodic.calls if c[0] == "epoch_end"] == [("epoch_end", 1, ["accuracy", "loss"])]
    assert periodic.calls[0] == ("train_begin",) and periodic.calls[-1] == ("train_end",)
    assert enabled.calls == [("train_begin",), ("epoch_begin", 1), ("batch_end", 0), ("batch_end", 1),
                             ("epoch_end", 1, ["accuracy", "loss"]), ("train_end",)]


def test_a_wrapped_keras_callback_keeps_on_train_end_for_completed_training(two_towers):
    """As unwrapped: when training fails, a Keras callback's on_train_end does not run."""
    model = mlp()
    hooks = KerasHooks()

    class Fail(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise RuntimeError("broken")

    with pytest.raises(RuntimeError, match="broken"):
        model.fit(_endless(), steps_per_epoch=2, epochs=2, verbose=0,
                  callbacks=[kt.callbacks.PeriodicTrigger(hooks, every_k_epochs=1), Fail()])
    assert ("epoch_end", 0, ["accuracy", "loss"]) in hooks.calls
    assert ("train_end",) not in hooks.calls


def test_wrappers_take_keras_callbacks_chief_only_as_unwrapped():
    assert kt.callbacks.PeriodicTrigger(keras.callbacks.CSVLogger("x.csv"), every_k_epochs=1).chief_only
    assert not kt.callbacks.EnableCallbackIf(keras.callbacks.EarlyStopping(), bool).chief_only
    runner = kt.callbacks.InferenceRunner(_validation(), [kt.callbacks.ClassificationError()])
    assert not kt.callbacks.PeriodicTrigger(runner, every_k_epochs=1).chief_only


def test_wrapping_what_cannot_be_scheduled_is_refused():
    class OldStyle(kt.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            super().on_epoch_end(epoch, logs)

    with pytest.raises(TypeError, match=r"OldStyle overrides on_epoch_end.*_trigger\(\)"):
        kt.callbacks.PeriodicTrigger(OldStyle(), every_k_epochs=1)
    with pytest.raises(TypeError, match="wraps a kt.callbacks.Callback or a keras.callbacks.Callback; got function"):
        kt.callbacks.EnableCallbackIf(lambda logs: None, bool)
