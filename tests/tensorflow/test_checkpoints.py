"""ModelSaver, AutoResume, MinSaver/MaxSaver: whole checkpoints, exact resume."""

import os

import keras
import numpy as np
import pytest

import kerastower as kt
from tests.tensorflow.helpers import TWO, Stop, StopAt, id_data


def _train(ckpt_dir, extra_callbacks=(), epochs=4):
    keras.utils.set_random_seed(42)
    x, y = id_data(48)
    x[:, 0] = 0.0
    with kt.distributed("mirrored", devices=TWO):
        inputs = keras.Input((4,))
        h = keras.layers.Dense(16, activation="relu")(inputs)
        h = keras.layers.Dropout(0.3)(h)
        h = keras.layers.BatchNormalization()(h)
        model = kt.TowerModel(inputs, keras.layers.Dense(3)(h))
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        callbacks = [
            kt.callbacks.AutoResume(ckpt_dir),
            kt.callbacks.PeriodicTrigger(kt.callbacks.ModelSaver(ckpt_dir, max_to_keep=2),
                                         every_k_steps=3),
            *extra_callbacks,
        ]
        model.fit(x, y, batch_size=4, steps_per_epoch=5, epochs=epochs, verbose=0,
                  callbacks=callbacks)
    return model


def test_resume_after_an_interruption_is_bit_equal(tmp_path):
    uninterrupted = _train(str(tmp_path / "a"))
    with pytest.raises(Stop):
        _train(str(tmp_path / "b"), [StopAt(11)])  # last checkpoint at step 9, mid-epoch 2
    saved = sorted(os.listdir(tmp_path / "b"))
    assert saved == ["ckpt-00000006", "ckpt-00000009"]  # max_to_keep=2
    resumed = _train(str(tmp_path / "b"))
    assert resumed.optimizer.iterations.numpy() == 20
    for a, b in zip(uninterrupted.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Without AutoResume's input position, the data order would differ: the test can fail.
    assert not all(
        np.array_equal(a, b) for a, b in zip(uninterrupted.get_weights(), _train(str(tmp_path / "c"), epochs=3).get_weights())
    )


def test_a_half_written_checkpoint_is_ignored(tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    with pytest.raises(Stop):
        _train(ckpt_dir, [StopAt(7)])
    # A save killed midway leaves a staging folder; a folder without a
    # manifest (copied in, or by an older version) is no checkpoint.
    os.makedirs(os.path.join(ckpt_dir, ".writing-abc"))
    os.makedirs(os.path.join(ckpt_dir, "ckpt-00000099"))
    assert kt.checkpoint.latest_checkpoint(ckpt_dir).endswith("ckpt-00000006")
    with pytest.raises(kt.checkpoint.DamagedCheckpointError, match="missing manifest.json"):
        kt.checkpoint.verify_checkpoint(os.path.join(ckpt_dir, "ckpt-00000099"))
    kt.checkpoint.clean_up(ckpt_dir)
    assert ".writing-abc" not in os.listdir(ckpt_dir)


def test_min_and_max_savers_keep_the_best_model(two_towers, tmp_path):
    x, y = id_data(32)
    x[:, 0] = 0.0
    inputs = keras.Input((4,))
    model = kt.TowerModel(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.05), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    low = kt.callbacks.MinSaver("loss", checkpoint_dir=str(tmp_path))
    high = kt.callbacks.MaxSaver("accuracy", "best-acc", checkpoint_dir=str(tmp_path))
    history = model.fit(x, y, batch_size=4, epochs=4, verbose=0, callbacks=[low, high])
    assert low.best == pytest.approx(min(history.history["loss"]))
    assert high.best == pytest.approx(max(history.history["accuracy"]))
    assert sorted(os.listdir(tmp_path)) == ["best-acc.keras", "min-loss.keras"]
    assert isinstance(keras.models.load_model(str(tmp_path / "min-loss.keras")), kt.TowerModel)


def test_min_and_max_savers_write_into_the_runs_log_folder(two_towers, tmp_path, monkeypatch):
    x, y = id_data(32)
    inputs = keras.Input((4,))
    model = kt.TowerModel(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    monkeypatch.chdir(tmp_path)  # where the savers used to write
    logdir = tmp_path / "runs" / "1"
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, logdir=logdir,
              callbacks=[kt.callbacks.MinSaver("loss"), kt.callbacks.MaxSaver("accuracy")])
    assert {"min-loss.keras", "max-accuracy.keras", "stats.json"} <= set(os.listdir(logdir))
    assert sorted(os.listdir(tmp_path)) == ["runs"]
    # Without a log folder or a checkpoint_dir, nothing trains and the error says what to give.
    with pytest.raises(kt.errors.KerasTowerError, match=r"MaxSaver\('accuracy'\) has no folder.*logdir="):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[kt.callbacks.MaxSaver("accuracy")])
    assert model.loop.global_step == 2 * 4


def test_sigkill_mid_epoch_then_resume_is_bit_equal(tmp_path, zygote):
    """A real process killed with SIGKILL in the middle of an epoch, resumed
    by a new process, ends with the weights of an uninterrupted run."""
    import signal
    import time

    script = os.path.join(os.path.dirname(__file__), "resume_script.py")

    def run(ckpt, out):
        done = zygote.run(script, [ckpt, out], output=f"{out}.stdout", errors=f"{out}.stderr")
        assert done.returncode == 0, done.stderr[-2000:]
        return done

    run(tmp_path / "a", tmp_path / "a.npz")

    killed_dir = tmp_path / "b"
    process = zygote.start(script, [killed_dir, tmp_path / "x.npz", "--slow"])
    deadline = time.time() + 240
    while not (killed_dir / "ckpt-00000008").exists():  # step 8: epoch 2, step 3 of 5
        assert process.poll() is None and time.time() < deadline, "the run ended before being killed"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert not (tmp_path / "x.npz").exists()

    resumed = run(killed_dir, tmp_path / "b.npz")
    assert "ckpt-00000008" in resumed.stdout  # resumed mid-epoch, at epoch 2 step 3
    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    assert int(a["step"]) == int(b["step"]) == 20
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_keep_checkpoint_every_n_hours_keeps_old_ones_past_max_to_keep(two_towers, tmp_path):
    x, y = id_data(32)
    inputs = keras.Input((4,))
    model = kt.TowerModel(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    every_save = kt.callbacks.ModelSaver(str(tmp_path / "kept"), max_to_keep=1,
                                         keep_checkpoint_every_n_hours=1e-9)
    only_last = kt.callbacks.ModelSaver(str(tmp_path / "last"), max_to_keep=1)
    model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[every_save, only_last])
    assert sorted(os.listdir(tmp_path / "last")) == ["ckpt-00000012"]
    assert sorted(os.listdir(tmp_path / "kept")) == ["ckpt-00000004", "ckpt-00000008", "ckpt-00000012"]
