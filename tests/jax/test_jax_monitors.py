"""fit(logdir=...) on JAX: TensorBoard scalars, stats.json and throughput, written
without TensorFlow and read back with tensorboard's own reader."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import jax
import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import kerastower as kt
from kerastower.callbacks.event_scalars import ScalarTensorBoard

# A fresh process: this one may have imported TensorFlow already. With
# "refused", importing TensorFlow fails there; with "installed", it would
# succeed, and must not happen either (tensorboard's own EventFileWriter
# imports it whenever it can).
SCRIPT = textwrap.dedent('''
    import json, sys

    class RefuseTensorFlow:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("tensorflow", "horovod"):
                raise ImportError(f"this test forbids importing {name}")

    if sys.argv[2] == "refused":
        sys.meta_path.insert(0, RefuseTensorFlow())
    import jax, keras, numpy as np
    import kerastower as kt

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    with kt.distributed("mirrored", devices=jax.devices()[:2]):
        inputs = keras.Input((4,))
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, logdir=sys.argv[1],
                            validation_data=(x[:16], y[:16]))
    print(json.dumps({"history": history.history, "steps": model.loop.global_step,
                      "tensorflow_imported": "tensorflow" in sys.modules}))
''')


def _scalars(folder):
    events = EventAccumulator(folder)
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


@pytest.mark.parametrize("tensorflow", ["refused", "installed"])
def test_fit_with_a_logdir_writes_tensorboard_scalars_without_tensorflow(tmp_path, tensorflow):
    env = dict(os.environ, KERAS_BACKEND="jax")
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), tensorflow], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["tensorflow_imported"] is False and result["steps"] == 12
    history = result["history"]
    assert sorted(os.listdir(tmp_path)) == ["stats.json", "train", "validation"]
    train = _scalars(str(tmp_path / "train"))
    validation = _scalars(str(tmp_path / "validation"))
    # Step scalars at every global step, epoch scalars at every epoch.
    assert [step for step, _ in train["batch_loss"]] == list(range(1, 13))
    for name in ("loss", "mae", "samples_per_sec"):
        assert [s for s, _ in train[f"epoch_{name}"]] == [0, 1, 2]
        np.testing.assert_allclose([v for _, v in train[f"epoch_{name}"]], history[name], rtol=1e-6)
    np.testing.assert_allclose([v for _, v in train["epoch_learning_rate"]], [0.05] * 3, rtol=1e-6)
    np.testing.assert_allclose([v for _, v in validation["epoch_loss"]], history["val_loss"], rtol=1e-6)
    with open(tmp_path / "stats.json") as f:
        assert [entry["epoch_num"] for entry in json.load(f)] == [1, 2, 3]


def _model():
    with kt.distributed("mirrored", devices=jax.devices()[:2]):
        inputs = keras.Input((3,))
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    return model


def test_update_freq_and_a_log_dir_that_cannot_be_written(tmp_path):
    x, y = np.ones((48, 3), "float32"), np.ones((48, 1), "float32")
    model = _model()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0,
              callbacks=[kt.callbacks.TensorBoard(str(tmp_path / "tb"), update_freq=4)])
    assert isinstance(kt.callbacks.TensorBoard(str(tmp_path)), ScalarTensorBoard)
    assert [s for s, _ in _scalars(str(tmp_path / "tb" / "train"))["batch_loss"]] == [4]
    blocked = tmp_path / "a_file"
    blocked.write_text("not a folder")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=4, epochs=2, verbose=0,
                            callbacks=[kt.callbacks.TensorBoard(str(blocked))])
    assert len(history.history["loss"]) == 2
    messages = [str(w.message) for w in caught if issubclass(w.category, kt.MonitorWriteWarning)]
    assert len(messages) == 1 and "a_file" in messages[0]
    with pytest.raises(kt.ArgumentError):
        kt.callbacks.TensorBoard(str(tmp_path), update_freq=0)


def test_two_writers_of_one_folder_keep_a_file_each(tmp_path):
    x, y = np.ones((16, 3), "float32"), np.ones((16, 1), "float32")
    model = _model()
    # Both open their files at the same step, within the same second.
    model.fit(x, y, batch_size=4, epochs=1, verbose=0,
              callbacks=[kt.callbacks.TensorBoard(str(tmp_path), update_freq="epoch") for _ in range(2)])
    files = sorted(os.listdir(tmp_path / "train"))
    assert len(files) == 2, files
    for name in files:
        assert [s for s, _ in _scalars(str(tmp_path / "train" / name))["epoch_loss"]] == [0]


def test_per_step_monitors_read_the_runs_counters_without_syncing_the_weights(tmp_path):
    """The progress bar, TensorBoard and ThroughputTracker read the loop's
    counters from the training run. They read them through `self.model`
    before, and Keras's `Callback.model` on JAX first writes the towers'
    weights into the model's variables: one sync per callback per step."""
    syncs = []

    class CountingSyncs(kt.TowerModel):
        def jax_state_sync(self):
            syncs.append(1)
            super().jax_state_sync()

    with kt.distributed("mirrored", devices=jax.devices()[:2]):
        inputs = keras.Input((3,))
        model = CountingSyncs(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((128, 3), "float32"), np.ones((128, 1), "float32")
    steps, epochs = 16, 2
    callbacks = [kt.callbacks.ThroughputTracker(), kt.callbacks.TensorBoard(str(tmp_path))]
    model.fit(x, y, batch_size=4, epochs=epochs, verbose=1, callbacks=callbacks)
    assert model.loop.global_step == steps * epochs
    # What is left is per epoch (its end's sync, the learning rate read).
    assert len(syncs) <= 5 * epochs, len(syncs)


def test_the_progress_bar_shows_its_steps_from_kerass_callback_thread(monkeypatch, capsys):
    """fit's progress bar (verbose=1) only shows a step's logs, so Keras's
    CallbackList runs its batch hook in its own thread, as it runs Keras's
    progress bar: reading a step's logs there never holds up the next
    step. It is handed each epoch's first step and its last (the steps
    between only where it may draw them, loop/batch_hooks.py)."""
    from kerastower.callbacks.monitors import ProgressBar

    shown = []
    original = ProgressBar.on_train_batch_end

    def noted(self, batch, logs=None):
        shown.append((batch, threading.current_thread() is threading.main_thread()))
        return original(self, batch, logs)

    monkeypatch.setattr(ProgressBar, "on_train_batch_end", noted)
    inputs = keras.Input((3,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((16, 3), "float32"), np.ones((16, 1), "float32")
    model.fit(x, y, batch_size=4, epochs=2, verbose=1)
    assert all(not in_loop for _, in_loop in shown)
    assert sorted(shown).count((0, False)) == 2 and sorted(shown).count((3, False)) == 2
    assert capsys.readouterr().out.count("4/4") >= 2


def test_a_reader_added_when_training_begins_runs_in_the_loops_thread():
    """With only the progress bar hooked, Keras's CallbackList chooses its
    thread when it is made; a callback added in on_train_begin whose batch
    hook reads the model must still run in the loop's thread, between the
    steps, and see each step's own weights."""
    seen = []

    def read(batch, logs):
        seen.append((batch, threading.current_thread() is threading.main_thread(),
                     int(added.model.optimizer.iterations)))

    added = keras.callbacks.LambdaCallback(on_train_batch_end=read)

    class AddsOne(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            added.set_model(self.model)
            callback_list.callbacks.append(added)

    inputs = keras.Input((3,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    callback_list = keras.callbacks.CallbackList(
        kt.callbacks.defaults.with_default_monitors([AddsOne()], verbose=1, logdir=None),
        add_history=True, model=model)
    x, y = np.ones((16, 3), "float32"), np.ones((16, 1), "float32")
    model.fit(x, y, batch_size=4, epochs=2, verbose=1, callbacks=callback_list)
    assert seen == [(step % 4, True, step + 1) for step in range(8)]


def test_only_kerastowers_own_progress_bar_is_async_safe():
    from kerastower.callbacks.monitors import ProgressBar

    class ShowsMore(ProgressBar):
        pass

    assert ProgressBar().async_safe is True
    assert ShowsMore().async_safe is False


def test_the_progress_bar_moves_forward_only(capsys):
    """Keras's thread pool may hand it a later step first."""
    from kerastower.callbacks.monitors import ProgressBar

    bar = ProgressBar()
    bar.set_params({"epochs": 1, "steps": 4, "verbose": 1})
    bar.training_run = type("Run", (), {"state": kt.LoopState()})()
    bar.on_train_begin()
    bar.on_epoch_begin(0)
    shown = []
    for batch in (0, 2, 1, 3):
        bar.on_train_batch_end(batch, {"loss": float(batch)})
        shown.append(bar.seen)
    assert shown == [1, 3, 3, 4]
