"""Faults in setting up a run: devices, log folders, arguments, mismatched data.

Each fault is real: device names TensorFlow is given, a log folder that is
a regular file, a disk that is full (/dev/full) or goes away (a pipe whose
reader closes), numpy integers and floats as arguments, and labels or
inputs that do not fit the model, trained on 2 towers.
"""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerastower as kt
from tests.tensorflow.helpers import TWO
from kerastower.errors import ArgumentError
from kerastower.errors import DataMismatchError
from kerastower.errors import MonitorWriteWarning

from tests.helpers.common import ROOT
FOUR_CPUS = "/device:CPU:0, /device:CPU:1, /device:CPU:2, /device:CPU:3"
MAKE_CPUS = "call kt.use_cpu_towers(N) at the start of the program"


def _regression(features=4, outputs=1, loss="mse", **compile_kwargs):
    inputs = keras.Input((features,))
    model = kt.TowerModel(inputs, keras.layers.Dense(outputs)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss, **compile_kwargs)
    return model


def _data(n=64, features=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    return x, (x @ np.linspace(-1.0, 1.0, features)[:, None]).astype("float32")


# -- A. devices ------------------------------------------------------------------

BAD_DEVICES = [
    ("mirrored", ["/cpu:0", "/cpu:9"], ["'/cpu:9' does not exist", MAKE_CPUS]),
    ("mirrored", [f"/cpu:{i}" for i in range(6)],
     ["'/cpu:4', '/cpu:5' do not exist", "6 CPU devices are asked for and 4 exist"]),
    ("mirrored", ["/cpu:0", "/CPU:0"], ["'/cpu:0' and '/CPU:0' both name", "name each device once"]),
    ("mirrored", ["cpu:1", "/job:localhost/replica:0/task:0/device:CPU:1"], ["both name /device:CPU:1"]),
    ("mirrored", ["foo", "/cpu:1"], ["'foo' is not a device name", "e.g. \"/cpu:0\""]),
    ("mirrored", ["/cpu"], ["'/cpu' does not name one device"]),
    ("mirrored", "/cpu:0", ["the string '/cpu:0'", "devices=['/cpu:0']"]),
    ("mirrored", [], ["empty list"]),
    ("mirrored", ["/job:worker/task:1/device:CPU:0"], ["another process", "multiworker"]),
    ("single", ["/cpu:7"], ["'/cpu:7' does not exist"]),
    ("single", ["/tpu:0"], ["'/tpu:0' asks for a TPU device"]),
]


@pytest.mark.parametrize("name, devices, expected", BAD_DEVICES)
def test_bad_devices_raise_at_once_listing_the_devices_there_are(name, devices, expected):
    x, y = _data(16)
    start = time.perf_counter()
    with pytest.raises(kt.StrategyError) as error:
        with kt.distributed(name, devices=devices):
            _regression().fit(x, y, batch_size=4, verbose=0)
    assert time.perf_counter() - start < 10
    message = str(error.value)
    assert f"This process has the logical devices {FOUR_CPUS}." in message
    for part in expected:
        assert part in message


_FRESH_PROCESS = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import keras
    import kerastower as kt

    x = np.ones((16, 4), "float32")
    for name, devices in json.loads(sys.argv[1]):
        start = time.perf_counter()
        try:
            with kt.distributed(name, devices=devices):
                inputs = keras.Input((4,))
                model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
                model.compile(optimizer="sgd", loss="mse")
                model.fit(x, x[:, :1], batch_size=4, verbose=0)
            outcome = {"error": None}
        except Exception as error:
            outcome = {"error": type(error).__name__, "message": str(error)}
        outcome.update(devices=devices, seconds=time.perf_counter() - start)
        print(json.dumps(outcome), flush=True)
""")


def test_gpus_and_missing_cpus_fail_fast_in_a_fresh_process_without_gpus():
    """Where there is no GPU, two GPU names used to hang in fit; in a plain
    process (one CPU device) "/cpu:1" used to run elsewhere. A hang fails
    this test by the subprocess timeout instead of hanging the suite."""
    cases = [["mirrored", ["/gpu:0", "/gpu:1"]], ["single", ["/gpu:0"]],
             ["mirrored", ["/cpu:0", "/cpu:1"]]]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, json.dumps(cases)],
                              capture_output=True, text=True, timeout=150, env=env)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"a bad device list hung; finished before: {hung.stdout!r}")
    outcomes = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(outcomes) == 3, done.stderr[-3000:]
    for outcome in outcomes:
        assert outcome["error"] == "StrategyError", outcome
        assert outcome["seconds"] < 10, outcome
        assert "This process has the logical devices /device:CPU:0." in outcome["message"]
    gpus, gpu, cpus = (o["message"] for o in outcomes)
    assert "'/gpu:0', '/gpu:1' ask for GPUs, but TensorFlow sees none" in gpus
    assert 'Name CPU devices instead, e.g. devices=["/cpu:0", "/cpu:1"]' in gpus
    assert "'/gpu:0' asks for a GPU" in gpu
    assert "'/cpu:1' does not exist" in cpus and MAKE_CPUS in cpus


def test_every_spelling_of_a_device_name_still_works():
    spellings = ["/cpu:0", "/CPU:1", "/device:CPU:2", "/job:localhost/replica:0/task:0/device:CPU:3"]
    with kt.distributed("mirrored", devices=spellings) as strategy:
        assert strategy.tf_strategy.extended.worker_devices == tuple(
            f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4))
    with kt.distributed("single", devices=["cpu:1"]) as strategy:
        assert strategy.tf_strategy.extended.worker_devices == (
            "/job:localhost/replica:0/task:0/device:CPU:1",)
    x, y = _data(32)
    with kt.distributed("mirrored", devices=("cpu:0", tf.config.list_logical_devices("CPU")[1])):
        model = _regression()
        history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert model.num_towers == 2 and history.history["loss"][1] < history.history["loss"][0]


# -- B. monitors -----------------------------------------------------------------

def _train_with_monitors(tmp_path, logdir, epochs=3):
    """Trains on 2 towers with fit(logdir=...) and a ModelSaver in another
    folder; returns (losses, MonitorWriteWarnings, checkpoints written)."""
    x, y = _data()
    ckpt = str(tmp_path / "ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with kt.distributed("mirrored", devices=TWO):
            model = _regression()
            history = model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, logdir=str(logdir),
                                callbacks=[kt.callbacks.ModelSaver(ckpt)])
    # The failed writer was not left as the default one: nothing is written.
    assert not bool(tf.summary.scalar("after_fit", 1.0, step=0))
    monitor_warnings = [str(w.message) for w in caught if w.category is MonitorWriteWarning]
    return history.history["loss"], monitor_warnings, sorted(os.listdir(ckpt))


def _one_each(monitor_warnings):
    """{monitor: its warning}, checking that each warned exactly once."""
    monitors = [text.split()[1] for text in monitor_warnings]
    assert len(monitors) == len(set(monitors)), monitor_warnings
    return dict(zip(monitors, monitor_warnings))


def test_logdir_that_is_a_file_warns_once_per_monitor_and_training_goes_on(tmp_path):
    logdir = tmp_path / "not_a_folder"
    logdir.write_text("a regular file")
    losses, monitor_warnings, checkpoints = _train_with_monitors(tmp_path, logdir)
    warned = _one_each(monitor_warnings)
    assert set(warned) == {"TensorBoard", "JSONWriter"}
    assert f"{logdir}/train (FailedPreconditionError: {logdir} is not a directory)" in warned["TensorBoard"]
    assert f"{logdir}/stats.json (FileExistsError: [Errno 17] File exists" in warned["JSONWriter"]
    for text in warned.values():
        assert "Training and checkpoints go on" in text
    assert len(losses) == 3 and losses[-1] < losses[0] / 2
    assert checkpoints == ["ckpt-00000004", "ckpt-00000008", "ckpt-00000012"]
    assert logdir.read_text() == "a regular file"


def test_full_disk_for_stats_json_warns_once_and_keeps_the_records(tmp_path):
    """The write of stats.json goes to /dev/full (ENOSPC); the records stay
    in memory and are all written once a write can succeed."""
    logdir = tmp_path / "logs"
    logdir.mkdir()
    os.symlink("/dev/full", logdir / "stats.json.writing")
    losses, monitor_warnings, checkpoints = _train_with_monitors(tmp_path, logdir)
    warned = _one_each(monitor_warnings)
    assert set(warned) == {"JSONWriter"}
    assert f"{logdir}/stats.json (OSError: [Errno 28] No space left on device)" in warned["JSONWriter"]
    assert losses[-1] < losses[0] / 2 and len(checkpoints) == 3
    records = json.loads((logdir / "stats.json").read_text())
    assert [r["epoch_num"] for r in records] == [1, 2, 3]


def _event_file_names(train_dir, probe_dir):
    """The names TensorFlow may give the next event files in `train_dir`,
    for the next minute, learnt from a probe writer's file name:
    events.out.tfevents.<time>.<host>.<pid>.<n>.v2, n counting writers."""
    tf.summary.create_file_writer(str(probe_dir)).close()
    (probe,) = os.listdir(probe_dir)
    host_and_pid = probe[len("events.out.tfevents."):].split(".", 1)[1].rsplit(".", 2)[0]
    n = int(probe.rsplit(".", 2)[1])
    now = int(time.time())
    return [os.path.join(train_dir, f"events.out.tfevents.{t}.{host_and_pid}.{n + k}.v2")
            for t in range(now - 2, now + 60) for k in (1, 2, 3)]


def test_full_disk_for_the_tensorboard_events_warns_once(tmp_path):
    logdir = tmp_path / "logs"
    (logdir / "train").mkdir(parents=True)
    (tmp_path / "probe").mkdir()
    for name in _event_file_names(logdir / "train", tmp_path / "probe"):
        os.symlink("/dev/full", name)
    losses, monitor_warnings, checkpoints = _train_with_monitors(tmp_path, logdir)
    warned = _one_each(monitor_warnings)
    if "TensorBoard" not in warned:
        pytest.fail(f"the events file did not land on /dev/full: {os.listdir(logdir / 'train')[:3]}")
    assert "(ResourceExhaustedError: " in warned["TensorBoard"]
    assert "No space left on device)" in warned["TensorBoard"]
    assert losses[-1] < losses[0] / 2 and len(checkpoints) == 3
    assert all(os.path.islink(logdir / "train" / name) for name in os.listdir(logdir / "train"))
    assert [r["epoch_num"] for r in json.loads((logdir / "stats.json").read_text())] == [1, 2, 3]


def test_log_folder_that_goes_away_mid_run_warns_once(tmp_path):
    """The events file is a pipe whose reader closes after the first
    events: a later flush fails (EPIPE) while the writer is the default
    one. The writer is taken down, and training goes on."""
    logdir = tmp_path / "logs"
    (logdir / "train").mkdir(parents=True)
    (tmp_path / "probe").mkdir()
    readers = []
    for name in _event_file_names(logdir / "train", tmp_path / "probe")[:90]:
        os.mkfifo(name)
        readers.append(os.open(name, os.O_RDONLY | os.O_NONBLOCK))
    received = []

    def read_then_close():
        import select

        while not received:
            ready, _, _ = select.select(readers, [], [], 30)
            for fd in ready:
                data = os.read(fd, 1 << 16)
                if data:
                    received.append(len(data))
            if not ready:
                break
        for fd in readers:
            os.close(fd)

    reader = threading.Thread(target=read_then_close, daemon=True)
    reader.start()
    losses, monitor_warnings, checkpoints = _train_with_monitors(tmp_path, logdir, epochs=4)
    reader.join(5)
    assert received, "TensorBoard never wrote to the pipe"
    warned = _one_each(monitor_warnings)
    assert set(warned) == {"TensorBoard"}, monitor_warnings
    assert "Broken pipe" in warned["TensorBoard"]
    assert losses[-1] < losses[0] / 2 and len(checkpoints) == 4


# -- C. arguments ----------------------------------------------------------------

def test_numpy_integers_are_accepted_wherever_ints_are(tmp_path):
    x, y = _data()
    ckpt, logs = str(tmp_path / "ckpt"), str(tmp_path / "logs")
    with kt.distributed("mirrored", devices=TWO):
        model = _regression(steps_per_execution=np.int64(2))
        callbacks = [
            kt.callbacks.PeriodicTrigger(kt.callbacks.ModelSaver(ckpt, max_to_keep=np.int64(2)),
                                         every_k_steps=np.int64(4)),
            kt.callbacks.PeriodicTrigger(kt.callbacks.JSONWriter(logs), every_k_epochs=np.int32(1)),
            kt.callbacks.ScheduledHyperParamSetter("learning_rate", [(np.int64(1), 0.05), (np.int32(2), 0.02)]),
            kt.callbacks.StatMonitorParamSetter("learning_rate", "loss", lambda v: v, 0.0, last_k=np.int64(1)),
            kt.callbacks.TensorBoard(logs, update_freq=np.int64(2)),
        ]
        history = model.fit(
            x, y, batch_size=np.int64(4), epochs=np.int32(3), verbose=np.int64(0),
            initial_epoch=np.int64(1), steps_per_epoch=np.int64(4), validation_data=(x, y),
            validation_steps=np.int64(2), validation_freq=np.int64(2), callbacks=callbacks)
        values = model.evaluate(x, y, batch_size=np.int32(8), steps=np.int64(2), verbose=np.int64(0))
        predictions = model.predict(x, batch_size=np.int64(8), steps=np.int32(2), verbose=np.int64(0))
    assert len(history.history["loss"]) == 2 and "val_loss" in history.history
    assert model.loop.global_step == 8 and np.isfinite(values)
    assert predictions.shape == (32, 1)
    assert sorted(os.listdir(ckpt)) == ["ckpt-00000004", "ckpt-00000008"]
    assert type(json.load(open(os.path.join(logs, "stats.json")))[-1]["global_step"]) is int


def _on_model(method):
    """Calls `method` of a fresh 2-tower model with the given arguments."""
    def call(**kwargs):
        x, y = _data(16)
        with kt.distributed("mirrored", devices=TWO):
            model = _regression(**(kwargs if method == "compile" else {}))
            if method != "compile":
                data = (x,) if method == "predict" else (x, y)
                getattr(model, method)(*data, **dict(dict(verbose=0), **kwargs))

    call.__name__ = method
    return call


def _trigger(**kwargs):
    kt.callbacks.PeriodicTrigger(kt.callbacks.ScalarPrinter(), **kwargs)


_fit, _evaluate, _predict, _compile = (_on_model(m) for m in ("fit", "evaluate", "predict", "compile"))


BAD_ARGUMENTS = [
    (_fit, "batch_size", 1.5), (_fit, "batch_size", True), (_fit, "epochs", "3"),
    (_fit, "epochs", True), (_fit, "steps_per_epoch", 2.5), (_fit, "initial_epoch", 1.0),
    (_fit, "validation_steps", "1"), (_fit, "verbose", "loud"), (_fit, "verbose", 0.5),
    (_evaluate, "steps", "2"), (_evaluate, "batch_size", np.float32(4)),
    (_predict, "batch_size", 2.0), (_predict, "steps", True),
    (_compile, "steps_per_execution", 1.5),
    (_trigger, "every_k_steps", 1.5), (_trigger, "every_k_steps", "3"),
    (_trigger, "every_k_epochs", True),
    (lambda **kw: kt.callbacks.StatMonitorParamSetter("lr", "loss", abs, 0.0, **kw), "last_k", 1.5),
    (lambda **kw: kt.callbacks.TensorBoard("logs", **kw), "update_freq", 2.5),
    (lambda **kw: kt.callbacks.ScheduledHyperParamSetter("lr", kw["schedule"]), "schedule",
     [(1.5, 0.1)]),
]


@pytest.mark.parametrize("call, name, value", BAD_ARGUMENTS,
                         ids=[f"{c.__name__}-{n}-{v!r}" for c, n, v in BAD_ARGUMENTS])
def test_non_integers_raise_an_error_naming_the_argument_and_value(call, name, value):
    with pytest.raises(ArgumentError) as error:
        call(**{name: value})
    message = str(error.value)
    shown = repr(value[0][0]) if name == "schedule" else repr(value)
    assert shown in message and ("the epoch of schedule point" if name == "schedule" else name) in message
    assert isinstance(error.value, kt.KerasTowerError)
    assert isinstance(error.value, TypeError) and isinstance(error.value, ValueError)


# -- D. data that does not fit the model -----------------------------------------

def _mismatch(build, x, y, method="fit", before=None):
    """The DataMismatchError `method` raises on 2 towers; checks the model
    was not trained."""
    with kt.distributed("mirrored", devices=TWO):
        model = build()
        if before is not None:
            model.fit(*before, batch_size=4, verbose=0)
        weights = [w.copy() for w in model.get_weights()]
        with pytest.raises(DataMismatchError) as error:
            getattr(model, method)(x, y, batch_size=4, verbose=0)
    for old, new in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(old, new)
    return error.value


def _classifier(loss, subclassed=False):
    def build():
        if subclassed:
            model = Dense3Model()
        else:
            inputs = keras.Input((4,))
            model = kt.TowerModel(inputs, keras.layers.Dense(3)(inputs))
        model.compile(optimizer="sgd", loss=loss)
        return model
    return build


class Dense3Model(kt.TowerModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)


X, _ = _data(32)
LABELS = np.random.default_rng(1).integers(0, 3, 32)


def test_labels_broadcast_by_mse_are_refused_before_training():
    error = _mismatch(_regression, X, np.ones((32, 3), "float32"))
    message = str(error)
    assert message.startswith("The batch of tower 0 of 2, train step (TowerModel.train_step)")
    assert "y (float32 (None, 3)) for output" in message and "(float32 (None, 1)) with mean_squared_error" in message
    assert "needs y of the output's shape (None, 1)" in message and "Reshape y" in message
    assert error.__cause__ is None  # Keras raises nothing here: it would broadcast


def test_sparse_labels_for_categorical_crossentropy_name_the_fix_and_chain_keras_error():
    error = _mismatch(_classifier("categorical_crossentropy"), X, LABELS)
    message = str(error)
    assert "tower 0 of 2, train step" in message and "y (int64 (None,))" in message
    assert 'Use loss="sparse_categorical_crossentropy"' in message
    assert "keras.utils.to_categorical(y, 3)" in message
    assert isinstance(error.__cause__, ValueError) and not isinstance(error.__cause__, kt.KerasTowerError)
    assert "target" in str(error.__cause__)


def test_one_hot_labels_for_sparse_crossentropy_in_evaluate():
    error = _mismatch(_classifier("sparse_categorical_crossentropy"), X,
                      np.eye(3, dtype="float32")[LABELS], method="evaluate")
    assert "tower 0 of 2, test step (TowerModel.test_step)" in str(error)
    assert "y looks one-hot" in str(error) and "np.argmax(y, axis=-1)" in str(error)


def test_x_that_does_not_fit_the_input_chains_keras_error_also_once_built():
    for before in (None, _data(16)):
        error = _mismatch(_regression, _data(32, features=5)[0], _data(32)[1], before=before)
        assert "x (float32 (None, 5)) does not fit the model's input (float32 (None, 4))" in str(error)
        assert "keras.Input(shape=(5,))" in str(error)
        assert "is incompatible with the layer" in str(error.__cause__)


def test_string_labels_and_string_inputs_are_named():
    error = _mismatch(_classifier("sparse_categorical_crossentropy"), X, np.array(["cat", "dog"] * 16))
    assert "y (string (None,))" in str(error) and "np.unique(y, return_inverse=True)" in str(error)
    error = _mismatch(_regression, np.array([["a"] * 4] * 32), _data(32)[1])
    assert "x (string (None, 4)) holds strings" in str(error)


def test_mismatch_found_while_a_tower_step_is_traced_names_it_and_chains_keras_error():
    """A subclassed model declares no outputs, so its built model meets the
    bad labels only in the traced tower step (and the validation data in
    the test step)."""
    one_hot = np.eye(3, dtype="float32")[LABELS]
    error = _mismatch(_classifier("categorical_crossentropy", subclassed=True), X, LABELS,
                      before=(X, one_hot))
    assert "tower 0 of 2, train step" in str(error) and "y looks like class indices" in str(error)
    assert isinstance(error.__cause__, ValueError) and "target" in str(error.__cause__)
    with kt.distributed("mirrored", devices=TWO):
        model = _regression()
        with pytest.raises(DataMismatchError, match=r"tower 0 of 2, test step .* y \(float32 \(None, 3\)\)"):
            model.fit(X, _data(32)[1], batch_size=4, verbose=0,
                      validation_data=(X, np.ones((32, 3), "float32")))


def test_other_errors_in_the_step_pass_through_unchanged():
    class VectorLoss(kt.TowerModel):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            return tf.reduce_sum(y_pred, axis=-1)  # not a scalar: a tower rule

    class RefusesToTrain(keras.layers.Layer):
        def call(self, x, training=None):
            if training:
                raise ValueError("my own layer refuses")
            return x

    x, y = _data(16)
    with kt.distributed("mirrored", devices=TWO):
        inputs = keras.Input((4,))
        model = VectorLoss(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
        with pytest.raises(kt.TowerRuleError, match="must be a scalar") as rule:
            model.fit(x, y, batch_size=4, verbose=0)
        assert not isinstance(rule.value, DataMismatchError)
        inputs = keras.Input((4,))
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(RefusesToTrain()(inputs)))
        model.compile(optimizer="sgd", loss="mse")
        with pytest.raises(ValueError, match="my own layer refuses") as own:
            model.fit(x, y, batch_size=4, verbose=0)
        assert not isinstance(own.value, DataMismatchError)
        # ... while a mismatch in the same place is explained.
        with pytest.raises(DataMismatchError):
            _regression().fit(x, np.ones((16, 2), "float32"), batch_size=4, verbose=0)
