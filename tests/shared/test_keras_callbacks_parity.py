"""Every callback in keras.callbacks, differentially (issue 26, item 6).

The same tiny model and data train three ways: (a) a stock `keras.Model`,
built outside any `kt.distributed` block; (b) a `kt.TowerModel` on 1 tower,
which must behave exactly as (a); (c) a `kt.TowerModel` on 2 towers with the
per-tower batch halved, which must behave as (a) on the joined batch (a
"batch" a callback sees is a step). Each test compares what the callback
leaves behind (weights, files, rows, payloads, event scalars, hook calls)
within 1e-5, and counts and file names exactly.
"""

import contextlib
import csv
import http.server
import json
import os
import tempfile
import threading
import urllib.parse

import h5py
import keras
import numpy as np
import pytest

import kerastower as kt

from tests.helpers.common import BACKEND
from tests.helpers.common import tower_devices

SEED = 1234
BATCH = 8           # one device's batch; 2 towers take BATCH // 2 each
ATOL = 1e-5


def _data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype("float32")
    w = rng.normal(size=(5, 1)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


X, Y = _data(32, seed=0)
X_VAL, Y_VAL = _data(16, seed=1)


@contextlib.contextmanager
def _scope(towers):
    """Stock Keras (towers=None) outside any block, or kt on `towers` towers."""
    if towers is None:
        yield
    else:
        with kt.distributed("mirrored", devices=tower_devices(towers)):
            yield


def _model(towers, optimizer=None, layers=None):
    """The same model with the same initial weights, stock or TowerModel.
    Layers are named, so that the weights files of all three agree.
    `optimizer` makes one: on TensorFlow it must be made in the towers'
    scope, as any Keras optimizer under a tf.distribute strategy."""
    keras.utils.set_random_seed(SEED)
    inputs = keras.Input((5,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    for layer in layers or ():
        h = layer(h)
    outputs = keras.layers.Dense(1, name="out")(h)
    cls = keras.Model if towers is None else kt.TowerModel
    model = cls(inputs, outputs, name="net")
    model.compile(optimizer=optimizer() if optimizer else keras.optimizers.SGD(0.1), loss="mse",
                  metrics=["mae"])
    return model


def _batch_size(towers):
    return BATCH // towers if towers else BATCH


def _fit(towers, callbacks=(), epochs=3, optimizer=None, validation=False, model=None, y=Y,
         **kwargs):
    """Builds (unless given) and trains one model on (X, y), validated on
    (X_VAL, Y_VAL) or `validation`; returns (model, history)."""
    with _scope(towers):
        if model is None:
            model = _model(towers, optimizer)
        if callable(callbacks):
            callbacks = callbacks(model)
        if validation is True:
            validation = (X_VAL, Y_VAL)
        history = model.fit(X, y, batch_size=_batch_size(towers), epochs=epochs, shuffle=False,
                            verbose=0, callbacks=list(callbacks),
                            validation_data=validation or None, **kwargs)
    return model, history


_STOCK = {}


def _stock(key, run):
    """Stock Keras's result of `run(folder)`, computed once for the module
    (both tower counts compare with it); `folder` is a fresh temporary one."""
    if key not in _STOCK:
        with tempfile.TemporaryDirectory() as folder:
            _STOCK[key] = run(folder)
    return _STOCK[key]


def _initial_weights():
    return _stock("initial weights", lambda _: _model(None).get_weights())


def _assert_weights(got, want, moved_from=None):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=ATOL)
    if moved_from is not None:
        assert any(not np.allclose(a, b, atol=1e-3) for a, b in zip(want, moved_from)), \
            "the weights did not move: the test could not fail"


def _assert_logs(got, want):
    """Two dicts of logs (or of lists of them): same keys, values within ATOL."""
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key], "float64"),
                                   np.asarray(want[key], "float64"), atol=ATOL, err_msg=key)


TOWERS = pytest.mark.parametrize("towers", [1, 2], ids=["1tower", "2towers"])


# --- BackupAndRestore --------------------------------------------------------


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, at_epoch=None, at_batch=None):
        super().__init__()
        self.at_epoch, self.at_batch = at_epoch, at_batch
        self.epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if self.at_batch is None and epoch == self.at_epoch:
            raise RuntimeError("interrupted")

    def on_train_batch_end(self, batch, logs=None):
        if self.at_batch is not None and (self.epoch, batch) == (self.at_epoch, self.at_batch):
            raise RuntimeError("interrupted")


def _adam():
    return keras.optimizers.Adam(0.05)   # state to restore too


def _interrupted_then_resumed(towers, backup_dir, save_freq, interrupt):
    backup = lambda: keras.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq)  # noqa: E731
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(towers, [backup(), interrupt], epochs=4, optimizer=_adam)
    epochs_run = []
    record = keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: epochs_run.append(e))
    model, history = _fit(towers, [backup(), record], epochs=4, optimizer=_adam)
    return model, history, epochs_run


@pytest.mark.parametrize("towers", [None, 1, 2], ids=["stock", "1tower", "2towers"])
def test_backup_and_restore_at_epoch_end_resumes_to_the_uninterrupted_weights(towers, tmp_path):
    want, _ = _stock("adam 4 epochs", lambda _: _fit(None, epochs=4, optimizer=_adam))
    model, history, epochs_run = _interrupted_then_resumed(
        towers, str(tmp_path / "backup"), "epoch", _Interrupt(at_epoch=1))
    assert epochs_run == [2, 3]
    assert len(history.history["loss"]) == 2
    assert int(np.asarray(model.optimizer.iterations)) == 4 * 4
    _assert_weights(model.get_weights(), want.get_weights(), moved_from=_initial_weights())
    assert not os.path.exists(tmp_path / "backup")   # deleted once training completed


@pytest.mark.parametrize("towers", [1, 2])
def test_backup_and_restore_beside_auto_resume_lets_the_step_exact_restore_win(towers, tmp_path, capsys):
    """Interrupted at epoch 2, batch 3 (global step 11): BackupAndRestore
    holds epoch 1's end (step 8), AutoResume's ModelSaver step 10. The
    resumed run goes on from step 10, BackupAndRestore loads nothing over
    it, and the weights equal an uninterrupted run's with the same callbacks."""

    def callbacks(folder):
        return lambda model: [
            keras.callbacks.BackupAndRestore(os.path.join(folder, "backup")),
            kt.callbacks.AutoResume(os.path.join(folder, "ckpt")),
            kt.callbacks.PeriodicTrigger(kt.callbacks.ModelSaver(os.path.join(folder, "ckpt")),
                                         every_k_steps=2)]

    straight, _ = _fit(towers, callbacks(str(tmp_path / "a")), epochs=4, optimizer=_adam)
    folder = str(tmp_path / "b")
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(towers, lambda model: callbacks(folder)(model) + [_Interrupt(at_epoch=2, at_batch=2)],
             epochs=4, optimizer=_adam)
    capsys.readouterr()
    resumed, _ = _fit(towers, callbacks(folder), epochs=4, optimizer=_adam)
    said = capsys.readouterr().out
    assert "ckpt-00000010 (global step 10), exact to the step; keras.callbacks.BackupAndRestore " \
        "does not load its backup over it" in said, said
    assert int(np.asarray(resumed.optimizer.iterations)) == 16
    for a, b in zip(straight.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("towers", [None, 1, 2], ids=["stock", "1tower", "2towers"])
def test_backup_and_restore_every_3_steps_resumes_the_epoch_it_was_in(towers, tmp_path):
    # Keras 3 saves (epoch, batch) but restores the epoch only: the
    # interrupted epoch runs again from its start, from the weights of the
    # last backup. Stock Keras, 1 tower and 2 towers must agree on all of it.
    backup_dir = str(tmp_path / "backup")
    want_model, want_history, want_epochs = _stock("backup every 3", lambda folder: (
        _interrupted_then_resumed(None, folder, 3, _Interrupt(at_epoch=1, at_batch=2))))
    if towers is None:
        # Backed up after global step 6 (epoch 1, batch 1); epoch 1 again.
        assert want_epochs == [1, 2, 3]
        assert int(np.asarray(want_model.optimizer.iterations)) == 6 + 3 * 4
        return
    model, history, epochs_run = _interrupted_then_resumed(
        towers, backup_dir, 3, _Interrupt(at_epoch=1, at_batch=2))
    assert epochs_run == want_epochs
    _assert_logs(history.history, want_history.history)
    assert (int(np.asarray(model.optimizer.iterations))
            == int(np.asarray(want_model.optimizer.iterations)))
    _assert_weights(model.get_weights(), want_model.get_weights(), moved_from=_initial_weights())


# --- ModelCheckpoint ---------------------------------------------------------


def _h5_datasets(path):
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
    return out


def _checkpoints(towers, folder):
    os.makedirs(folder)
    path = os.path.join(folder, "e{epoch}-b{batch}.weights.h5")
    _fit(towers, [keras.callbacks.ModelCheckpoint(path, save_weights_only=True, save_freq=3)],
         epochs=2)
    return {name: _h5_datasets(os.path.join(folder, name)) for name in sorted(os.listdir(folder))}


@TOWERS
def test_model_checkpoint_every_3_steps_writes_the_same_files_and_weights(towers, tmp_path):
    want = _stock("checkpoints", lambda folder: _checkpoints(None, os.path.join(folder, "ckpt")))
    got = _checkpoints(towers, str(tmp_path / "kt"))
    # 4 steps an epoch, 8 in all: saved after global steps 3 and 6.
    assert sorted(want) == ["e1-b3.weights.h5", "e2-b2.weights.h5"]
    assert sorted(got) == sorted(want)
    for name in want:
        assert sorted(got[name]) == sorted(want[name]), name
        for key in want[name]:
            np.testing.assert_allclose(got[name][key], want[name][key], atol=ATOL, err_msg=key)
    first, second = (want[name] for name in sorted(want))
    assert any(not np.allclose(first[k], second[k]) for k in first)


# --- CSVLogger ---------------------------------------------------------------


def _csv_rows(towers, path):
    _fit(towers, [keras.callbacks.CSVLogger(path)], validation=True)
    with open(path) as f:
        return list(csv.reader(f))


@TOWERS
def test_csv_logger_writes_the_same_rows(towers, tmp_path):
    want = _stock("csv", lambda folder: _csv_rows(None, os.path.join(folder, "log.csv")))
    got = _csv_rows(towers, str(tmp_path / "kt.csv"))
    assert got[0] == want[0]
    assert want[0][0] == "epoch" and {"loss", "mae", "val_loss", "val_mae"} <= set(want[0])
    assert [row[0] for row in got[1:]] == [row[0] for row in want[1:]] == ["0", "1", "2"]
    np.testing.assert_allclose(np.array(got[1:], "float64"), np.array(want[1:], "float64"),
                               atol=ATOL)
    losses = [float(row[want[0].index("loss")]) for row in want[1:]]
    assert losses[-1] < losses[0]


# --- EarlyStopping -----------------------------------------------------------


def _early_stopping(towers):
    # Trained towards 4 * Y, judged against 2 * Y: val_loss falls while the
    # outputs approach 2 * Y, then rises; the best epoch's weights come back.
    stop = keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True)
    model, history = _fit(towers, [stop], epochs=30, y=4 * Y, validation=(X, 2 * Y),
                          optimizer=lambda: keras.optimizers.SGD(0.02))
    return model, history, stop


@TOWERS
def test_early_stopping_stops_at_the_same_epoch_and_restores_the_same_weights(towers):
    want_model, want_history, want_stop = _stock("early stopping", lambda _: _early_stopping(None))
    model, history, stop = _early_stopping(towers)
    assert 0 < want_stop.best_epoch < want_stop.stopped_epoch < 29   # it did stop, and restore
    assert (stop.stopped_epoch, stop.best_epoch) == (want_stop.stopped_epoch, want_stop.best_epoch)
    assert len(history.history["loss"]) == len(want_history.history["loss"])
    _assert_logs(history.history, want_history.history)
    _assert_weights(model.get_weights(), want_model.get_weights(), moved_from=_initial_weights())
    # The restored weights are the best epoch's, not the last one's.
    best = want_history.history["val_loss"][want_stop.best_epoch]
    assert best < want_history.history["val_loss"][-1] - 0.1
    restored = model.evaluate(X, 2 * Y, verbose=0, return_dict=True)["loss"]
    assert restored == pytest.approx(best, abs=ATOL)


# --- ReduceLROnPlateau, LearningRateScheduler ---------------------------------


def _learning_rates(towers, callback):
    seen = []
    record = lambda model: keras.callbacks.LambdaCallback(  # noqa: E731
        on_epoch_end=lambda e, logs: seen.append(float(np.asarray(model.optimizer.learning_rate))))
    model, history = _fit(towers, lambda model: [callback(), record(model)], epochs=4)
    return model, history, seen


@TOWERS
def test_reduce_lr_on_plateau_lowers_the_same_learning_rate_at_the_same_epochs(towers):
    # min_delta too large to improve: every epoch is a plateau.
    plateau = lambda: keras.callbacks.ReduceLROnPlateau(  # noqa: E731
        monitor="loss", factor=0.5, patience=1, min_delta=10.0, min_lr=0.0)
    want_model, want_history, want_seen = _stock(
        "plateau", lambda _: _learning_rates(None, plateau))
    model, history, seen = _learning_rates(towers, plateau)
    # Epoch 0 sets the best loss; every later one is a plateau.
    np.testing.assert_allclose(want_seen, [0.1, 0.05, 0.025, 0.0125], rtol=1e-6)
    np.testing.assert_allclose(seen, want_seen, rtol=1e-6)
    np.testing.assert_allclose(history.history["learning_rate"],
                               want_history.history["learning_rate"], rtol=1e-6)
    _assert_logs(history.history, want_history.history)
    # The lowered rate trained every tower: the weights agree.
    _assert_weights(model.get_weights(), want_model.get_weights(), moved_from=_initial_weights())


@TOWERS
def test_learning_rate_scheduler_sets_the_same_rate_every_epoch(towers):
    schedule = lambda: keras.callbacks.LearningRateScheduler(  # noqa: E731
        lambda epoch, lr: 0.2 / (epoch + 1))
    want_model, want_history, want_seen = _stock(
        "scheduler", lambda _: _learning_rates(None, schedule))
    model, history, seen = _learning_rates(towers, schedule)
    np.testing.assert_allclose(want_seen, [0.2, 0.1, 0.2 / 3, 0.05], rtol=1e-6)
    np.testing.assert_allclose(seen, want_seen, rtol=1e-6)
    _assert_logs(history.history, want_history.history)
    _assert_weights(model.get_weights(), want_model.get_weights(), moved_from=_initial_weights())


# --- LambdaCallback ----------------------------------------------------------


def _hook_calls(towers):
    calls = []

    def record(name, i, logs):
        logs = logs or {}
        calls.append((name, i, sorted(logs), {k: float(v) for k, v in logs.items()}))

    def hook(name, with_index=True):
        if with_index:
            return lambda i, logs=None: record(name, i, logs)
        return lambda logs=None: record(name, None, logs)

    callback = keras.callbacks.LambdaCallback(
        on_train_begin=hook("on_train_begin", False), on_train_end=hook("on_train_end", False),
        on_epoch_begin=hook("on_epoch_begin"), on_epoch_end=hook("on_epoch_end"),
        on_train_batch_begin=hook("on_train_batch_begin"),
        on_train_batch_end=hook("on_train_batch_end"),
        on_test_begin=hook("on_test_begin", False), on_test_end=hook("on_test_end", False),
        on_test_batch_begin=hook("on_test_batch_begin"),
        on_test_batch_end=hook("on_test_batch_end"))
    _fit(towers, [callback], epochs=2, validation=True)
    return calls


def _expected_hooks(epochs=2, steps=4, val_steps=2):
    """Stock Keras's hooks for 32 examples in batches of 8 (2 towers: steps of
    2 x 4) validated on 16."""
    return ([("on_train_begin", None)]
            + [call for epoch in range(epochs) for call in (
                [("on_epoch_begin", epoch)]
                + [(hook, b) for b in range(steps)
                   for hook in ("on_train_batch_begin", "on_train_batch_end")]
                + [("on_test_begin", None)]
                + [(hook, b) for b in range(val_steps)
                   for hook in ("on_test_batch_begin", "on_test_batch_end")]
                + [("on_test_end", None), ("on_epoch_end", epoch)])]
            + [("on_train_end", None)])


@TOWERS
def test_lambda_callback_hooks_end_with_the_same_indices_and_logs(towers):
    # Every hook but the *_batch_begin ones (see the test below): same
    # order, same batch and epoch indices, same logs within 1e-5.
    want = _stock("hooks", lambda _: _hook_calls(None))
    got = _hook_calls(towers)
    assert [(name, i) for name, i, _, _ in want] == _expected_hooks()
    want = [call for call in want if not call[0].endswith("_batch_begin")]
    got = [call for call in got if not call[0].endswith("_batch_begin")]
    assert [call[:3] for call in got] == [call[:3] for call in want]
    for (name, i, _, a), (_, _, _, b) in zip(got, want):
        for key in b:
            assert a[key] == pytest.approx(b[key], abs=ATOL), (name, i, key)
    losses = [logs["loss"] for name, _, _, logs in want if name == "on_train_batch_end"]
    assert losses[-1] < losses[0]


@TOWERS
def test_lambda_callback_every_batch_begin_is_stock_keras_own(towers):
    assert [(name, i) for name, i, _, _ in _hook_calls(towers)] == _expected_hooks()


# --- SwapEMAWeights ----------------------------------------------------------


def _ema_run(towers):
    optimizer = lambda: keras.optimizers.SGD(0.2, use_ema=True, ema_momentum=0.5)  # noqa: E731
    seen = []
    record = lambda model: keras.callbacks.LambdaCallback(  # noqa: E731
        on_epoch_end=lambda e, logs: seen.append([np.array(w) for w in model.get_weights()]))
    # swap_on_epoch: the epoch's other callbacks see the EMA weights.
    callbacks = lambda model: [keras.callbacks.SwapEMAWeights(swap_on_epoch=True),  # noqa: E731
                               record(model)]
    model, history = _fit(towers, callbacks, validation=True, optimizer=optimizer)
    return model, history, seen


@TOWERS
def test_swap_ema_weights_evaluates_and_ends_with_the_same_ema_weights(towers):
    want_model, want_history, want_seen = _stock("ema", lambda _: _ema_run(None))
    model, history, seen = _ema_run(towers)
    _assert_logs(history.history, want_history.history)
    assert len(seen) == len(want_seen) == 3
    for got_epoch, want_epoch in zip(seen, want_seen):
        _assert_weights(got_epoch, want_epoch)
    _assert_weights(model.get_weights(), want_model.get_weights(), moved_from=_initial_weights())
    # Validation saw the EMA weights, and training ends with them: a run
    # without EMA validates and ends otherwise.
    plain, plain_history = _stock("no ema", lambda _: _fit(
        None, validation=True, optimizer=lambda: keras.optimizers.SGD(0.2)))
    assert not np.allclose(plain_history.history["val_loss"], want_history.history["val_loss"],
                           atol=1e-3)
    assert any(not np.allclose(a, b, atol=1e-3)
               for a, b in zip(plain.get_weights(), want_model.get_weights()))


# --- TensorBoard -------------------------------------------------------------


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    accumulator = EventAccumulator(folder, size_guidance={"tensors": 0, "scalars": 0})  # keep all
    accumulator.Reload()
    out = {}
    for tag in accumulator.Tags()["tensors"]:
        values = [(e.step, tensor_util.make_ndarray(e.tensor_proto))
                  for e in accumulator.Tensors(tag)]
        if all(v.dtype.kind == "f" and v.size == 1 for _, v in values):   # scalars only
            out[tag] = [(step, float(v)) for step, v in values]
    for tag in accumulator.Tags()["scalars"]:
        out[tag] = [(e.step, float(e.value)) for e in accumulator.Scalars(tag)]
    return out


def _tensorboard(towers, logdir):
    _fit(towers, [keras.callbacks.TensorBoard(logdir, update_freq="batch", profile_batch=0)],
         validation=True)
    return {sub: _scalars(os.path.join(logdir, sub)) for sub in ("train", "validation")}


def _assert_same_scalars(got, want):
    assert sorted(got) == sorted(want)
    for tag in want:
        assert [s for s, _ in got[tag]] == [s for s, _ in want[tag]], tag
        np.testing.assert_allclose([v for _, v in got[tag]], [v for _, v in want[tag]], atol=ATOL,
                                   err_msg=tag)


@TOWERS
def test_tensorboard_writes_the_same_scalars(towers, tmp_path):
    # Tags, values and epoch steps; the batch steps are the next test's.
    want = _stock("tensorboard", lambda folder: _tensorboard(None, folder))
    got = _tensorboard(towers, str(tmp_path / "kt"))
    assert {"batch_loss", "batch_mae", "epoch_loss", "epoch_mae",
            "epoch_learning_rate"} <= set(want["train"])
    assert len(want["train"]["batch_loss"]) == 12   # 3 epochs x 4 steps
    assert [s for s, _ in want["train"]["epoch_loss"]] == [0, 1, 2]
    assert {"epoch_loss", "epoch_mae", "evaluation_loss_vs_iterations"} <= set(want["validation"])
    # evaluation_*_vs_iterations is written at optimizer.iterations: 4, 8, 12.
    assert [s for s, _ in want["validation"]["evaluation_loss_vs_iterations"]] == [4, 8, 12]
    for sub in want:
        batch_steps = lambda scalars: {  # noqa: E731
            tag: [(i, v) for i, (_, v) in enumerate(values)] if tag.startswith("batch_") else values
            for tag, values in scalars.items()}
        _assert_same_scalars(batch_steps(got[sub]), batch_steps(want[sub]))
    batch_losses = [v for _, v in want["train"]["batch_loss"]]
    assert batch_losses[-1] < batch_losses[0]


@TOWERS
def test_tensorboard_writes_batch_scalars_at_stock_keras_steps(towers, tmp_path):
    got = _tensorboard(towers, str(tmp_path / "kt"))
    assert [s for s, _ in got["train"]["batch_loss"]] == list(range(1, 13))


class _CustomSummary(keras.layers.Layer):
    """Writes the mean of its input with tf.summary, as Keras's TensorBoard
    docs show for custom batch-level summaries."""

    def call(self, x):
        import tensorflow as tf

        tf.summary.scalar("custom_mean", tf.reduce_mean(x))
        return x


def _custom_summaries(towers, logdir):
    with _scope(towers):
        model = _model(towers, layers=[_CustomSummary(name="summ")])
        model.fit(X, Y, batch_size=_batch_size(towers), epochs=2, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.TensorBoard(logdir, update_freq="batch",
                                                         profile_batch=0)])
    scalars = _scalars(os.path.join(logdir, "train"))
    return {tag: values for tag, values in scalars.items() if tag.endswith("custom_mean")}


TF_ONLY = pytest.mark.skipif(BACKEND != "tensorflow", reason=(
    "a tf.summary op in a layer's call runs on TensorFlow only: on JAX the call is "
    "traced by JAX, in stock Keras too"))


@TF_ONLY
def test_tensorboard_custom_summary_from_a_layer(tmp_path):
    want = _stock("custom summary", lambda folder: _custom_summaries(None, folder))
    one = _custom_summaries(1, str(tmp_path / "one"))
    two = _custom_summaries(2, str(tmp_path / "two"))
    (want_values,), (one_values,), (two_values,) = want.values(), one.values(), two.values()
    assert len(want_values) == 8   # 2 epochs x 4 batches
    # 1 tower: the same values at the same steps (stock Keras writes them all
    # at the step current when the train function was traced).
    np.testing.assert_allclose([v for _, v in one_values], [v for _, v in want_values], atol=ATOL)
    assert [s for s, _ in one_values] == [s for s, _ in want_values]
    # 2 towers: one value a step (one tower's, not one per tower), and not
    # the joined batch's: a tower sees its own half batch.
    assert len(two_values) == 8
    assert not np.allclose([v for _, v in two_values], [v for _, v in want_values], atol=1e-3)


@TF_ONLY
def test_tensorboard_custom_summary_tag_is_stock_keras_own(tmp_path):
    want = _stock("custom summary", lambda folder: _custom_summaries(None, folder))
    got = _custom_summaries(1, str(tmp_path / "one"))
    assert sorted(got) == sorted(want)


# --- RemoteMonitor -----------------------------------------------------------


@pytest.fixture
def post_server():
    """A local HTTP server that keeps the body of every POST it gets."""
    received = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"])).decode()
            received.append((self.path, body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _payloads(towers, root, received):
    del received[:]
    _fit(towers, [keras.callbacks.RemoteMonitor(root=root, path="/epoch/")], validation=True)
    out = []
    for path, body in received:
        assert path == "/epoch/"
        form = urllib.parse.parse_qs(body)
        out.append(json.loads(form["data"][0]))
    return out


@TOWERS
def test_remote_monitor_posts_the_same_payloads(towers, post_server):
    root, received = post_server
    want = _payloads(None, root, received)
    got = _payloads(towers, root, received)
    assert [p["epoch"] for p in want] == [0, 1, 2]
    assert {"loss", "mae", "val_loss", "val_mae"} <= set(want[0])
    assert want[-1]["loss"] < want[0]["loss"]
    assert [p["epoch"] for p in got] == [0, 1, 2]
    for a, b in zip(got, want):
        _assert_logs(a, b)
