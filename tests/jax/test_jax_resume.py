"""Checkpoints and exact resume on JAX: variables.npz, no TensorFlow, and a
run killed with SIGKILL mid-epoch that a new process ends bit for bit."""

import os
import signal
import time

import jax
import keras
import numpy as np
import pytest

import kerastower as kt

SCRIPT = os.path.join(os.path.dirname(__file__), "resume_script_jax.py")


from tests.helpers.common import Stop, StopAt


def _model():
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    h = keras.layers.Dropout(0.3)(h)
    model = kt.TowerModel(inputs, keras.layers.Dense(3)(h))
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(n=44):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n).astype("int32")


class Numbered(keras.utils.PyDataset):
    """7 batches of 4 examples; which batch came when shows in the weights."""

    def __init__(self):
        super().__init__()
        self.x, self.y = _data(28)

    def __len__(self):
        return 7

    def __getitem__(self, index):
        part = slice(4 * index, 4 * index + 4)
        return self.x[part], self.y[part]


def _batches():
    x, y = _data(400)
    for start in range(0, 400, 4):
        yield x[start:start + 4], y[start:start + 4]


def _train(ckpt_dir, kind, extra=(), epochs=3):
    keras.utils.set_random_seed(42)
    with kt.distributed("mirrored", devices=jax.devices()[:2]):
        model = _model()
        callbacks = [
            kt.callbacks.AutoResume(ckpt_dir),
            kt.callbacks.PeriodicTrigger(kt.callbacks.ModelSaver(ckpt_dir), every_k_steps=3),
            *extra,
        ]
        if kind == "arrays":  # 44 examples: 6 steps a pass, passes crossed
            x, y = _data()
            model.fit(x, y, batch_size=4, steps_per_epoch=4, epochs=epochs, verbose=0,
                      callbacks=callbacks)
        elif kind == "pydataset":  # 4 steps a pass, an epoch a pass, reshuffled
            model.fit(Numbered(), epochs=epochs, verbose=0, callbacks=callbacks)
        else:
            model.fit(_batches(), steps_per_epoch=4, epochs=epochs, verbose=0,
                      callbacks=callbacks)
    return model


def _equal(a, b):
    return all(np.array_equal(u, v) for u, v in zip(a.get_weights(), b.get_weights()))


# arrays: ckpt 9 is step 3 of pass 2; PyDataset: ckpt 6, step 2 of epoch 2's
# pass of 4; generator: ckpt 6, 12 batches in.
@pytest.mark.parametrize("kind, stop_at, latest", [
    ("arrays", 11, 9), ("pydataset", 7, 6), ("generator", 7, 6)])
def test_resume_in_process_is_bit_equal(tmp_path, kind, stop_at, latest):
    whole = _train(str(tmp_path / "a"), kind)
    with pytest.raises(Stop):
        _train(str(tmp_path / "b"), kind, [StopAt(stop_at)])
    assert kt.checkpoint.latest_checkpoint(str(tmp_path / "b")).endswith(f"ckpt-{latest:08d}")
    resumed = _train(str(tmp_path / "b"), kind)
    assert int(resumed.optimizer.iterations.numpy()) == int(whole.optimizer.iterations.numpy())
    assert _equal(whole, resumed)
    # Resumed without the input position, the batches would differ: the test can fail.
    assert not _equal(whole, _train(str(tmp_path / "c"), kind, epochs=2))


def test_jax_checkpoint_is_numpy_and_round_trips(tmp_path):
    keras.utils.set_random_seed(3)
    model = _model()
    x, y = _data()
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    state = {"global_step": 5, "epoch_num": 1, "local_step": 5}
    path = kt.checkpoint.write_checkpoint(str(tmp_path), model, state)
    assert sorted(os.listdir(path)) == ["manifest.json", "state.json", "variables.npz"]
    saved = [w.copy() for w in model.get_weights()]
    optimizer_saved = [np.asarray(v.value).copy() for v in model.optimizer.variables]
    for v in model.variables + model.optimizer.variables:
        v.assign(np.zeros(v.shape, v.dtype))
    assert kt.checkpoint.read_checkpoint(path, model) == state
    for a, b in zip(saved, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, v in zip(optimizer_saved, model.optimizer.variables):
        np.testing.assert_array_equal(a, np.asarray(v.value))
    stored = np.load(os.path.join(path, "variables.npz"))
    assert "optimizer/adam/iteration" in stored.files
    assert "model/dense/kernel" in stored.files
    # A damaged newer checkpoint is skipped for the intact older one.
    newer = kt.checkpoint.write_checkpoint(
        str(tmp_path), model, dict(state, global_step=9, local_step=9))
    with open(os.path.join(newer, "variables.npz"), "r+b") as f:
        f.seek(40)
        f.write(b"\0\1\2\3")
    with pytest.warns(UserWarning, match="checksum mismatch in variables.npz"):
        restored, _ = kt.checkpoint.restore_latest(str(tmp_path), model)
    assert restored == path


class SaveThenRestore(keras.callbacks.Callback):
    """Writes a checkpoint at step 2 and restores it at step 4, through a
    reference to the model that does not sync it (unlike `self.model`)."""

    def __init__(self, model, folder):
        super().__init__()
        self.target = model
        self.folder = folder
        self.saved = None

    def on_train_batch_end(self, batch, logs=None):
        step = self.target.loop.global_step
        state = {"global_step": step, "epoch_num": 1, "local_step": step}
        if step == 2:
            self.path = kt.checkpoint.write_checkpoint(self.folder, self.target, state)
            self.saved = [w.copy() for w in self.model.get_weights()]
        elif step == 4:
            kt.checkpoint.read_checkpoint(self.path, self.target)
            self.target.stop_training = True


def test_checkpoints_see_the_weights_the_towers_hold(tmp_path):
    """A write saves the weights of the last step, though the towers hold them
    on device; a restore is not overwritten by what they held before it."""
    x, y = _data()
    with kt.distributed("mirrored", devices=jax.devices()[:2]):
        model = _model()
        callback = SaveThenRestore(model, str(tmp_path))
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[callback])
    assert int(model.optimizer.iterations.numpy()) == 2
    for a, b in zip(callback.saved, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_sigkill_mid_epoch_then_resume_is_bit_equal(tmp_path, zygote):
    """A real process killed with SIGKILL mid-epoch, resumed by a new process,
    ends with the weights of an uninterrupted run; neither imports TensorFlow."""

    def run(ckpt, out):
        done = zygote.run(SCRIPT, [ckpt, out], output=f"{out}.stdout", errors=f"{out}.stderr")
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    whole = run(tmp_path / "a", tmp_path / "a.npz")
    assert "tensorflow imported: False" in whole.stdout

    killed_dir = tmp_path / "b"
    process = zygote.start(SCRIPT, [killed_dir, tmp_path / "x.npz", "--slow"])
    deadline = time.time() + 240
    while not (killed_dir / "ckpt-00000010").exists():  # epoch 2, step 2 of 8
        assert process.poll() is None, "the run ended before being killed"
        assert time.time() < deadline, "no checkpoint of step 10 in time"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert not (tmp_path / "x.npz").exists()

    resumed = run(killed_dir, tmp_path / "b.npz")
    restored = resumed.stdout.split("resumed from", 1)[1].split()[0]
    step = int(restored.rsplit("ckpt-", 1)[1])
    assert step >= 10 and step % 8 != 0, restored  # mid-epoch
    assert "tensorflow imported: False" in resumed.stdout
    a, b = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    assert int(a["step"]) == int(b["step"]) == 24
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
