"""Monitors: TensorBoard and stats.json read back, throughput over all towers,
on both backends (TensorFlow writes summaries as tensors, the JAX backend as
scalars; _scalars reads either)."""

import json
import os

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util

import kerastower as kt

from tests.helpers.common import BACKEND
from tests.helpers.common import endless
from tests.helpers.common import id_data
from tests.helpers.common import mlp
from tests.helpers.common import tower_devices


def _endless(n=32, batch=4):
    x, y = id_data(n)
    x[:, 0] = 0.0
    return endless(x, y, batch)


def _events(logdir, tag):
    """[(step, value)] of `tag` in logdir/train: a tensor summary
    (tf.summary) or a scalar (the JAX backend's writer)."""
    accumulator = event_accumulator.EventAccumulator(os.path.join(logdir, "train"))
    accumulator.Reload()
    if tag in accumulator.Tags()["scalars"]:
        return [(e.step, e.value) for e in accumulator.Scalars(tag)]
    return [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in accumulator.Tensors(tag)]


def test_logdir_gives_tensorboard_scalars_and_stats_json(two_towers, tmp_path):
    model = mlp()
    logdir = str(tmp_path / "run")
    history = model.fit(_endless(), steps_per_epoch=3, epochs=2, verbose=0, logdir=logdir)

    steps = _scalar_steps(logdir, "batch_loss")
    assert steps == [1, 2, 3, 4, 5, 6]  # every step, at the global step
    epoch_losses = [value for _, value in _events(logdir, "epoch_loss")]
    np.testing.assert_allclose(epoch_losses, history.history["loss"], rtol=1e-6)

    with open(os.path.join(logdir, "stats.json")) as f:
        records = json.load(f)
    assert [(r["epoch_num"], r["global_step"]) for r in records] == [(1, 3), (2, 6)]
    assert [r["loss"] for r in records] == pytest.approx(history.history["loss"])
    for record in records:
        # samples/s over steps/s is the examples per step: 2 towers x 4.
        assert record["samples_per_sec"] / record["steps_per_sec"] == pytest.approx(8)


def test_stats_json_continues_after_a_resume(tmp_path):
    keras.utils.set_random_seed(1234)
    logdir, ckpt = str(tmp_path / "logs"), str(tmp_path / "ckpt")

    class StopAfter(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 2:  # epoch 3 is recorded, then lost: the last checkpoint is epoch 2's
                raise RuntimeError("killed")

    def run(extra, epochs=4):
        with kt.distributed("mirrored", devices=tower_devices(2)):
            model = mlp()
            callbacks = [kt.callbacks.AutoResume(ckpt),
                         kt.callbacks.PeriodicTrigger(kt.callbacks.ModelSaver(ckpt), every_k_epochs=2),
                         *extra]
            model.fit(_endless(), steps_per_epoch=2, epochs=epochs, verbose=0, logdir=logdir,
                      callbacks=callbacks)

    with pytest.raises(RuntimeError, match="killed"):
        run([StopAfter()])
    run([])
    with open(os.path.join(logdir, "stats.json")) as f:
        records = json.load(f)
    assert [(r["epoch_num"], r["global_step"]) for r in records] == [(1, 2), (2, 4), (3, 6), (4, 8)]


def test_progress_bar_shows_samples_per_second(two_towers, capsys):
    model = mlp()
    model.fit(_endless(), steps_per_epoch=3, epochs=1, verbose=1)
    assert "samples/s" in capsys.readouterr().out


def test_the_epoch_line_shows_inference_runner_figures_and_the_learning_rate(two_towers, capsys):
    x, y = id_data(16)
    model = mlp(optimizer=keras.optimizers.SGD(0.0123))
    runner = kt.callbacks.InferenceRunner((x, y), [kt.callbacks.ScalarStats(["loss", "accuracy"])])
    model.fit(_endless(), steps_per_epoch=2, epochs=2, verbose=2, callbacks=[runner])
    lines = [line for line in capsys.readouterr().out.splitlines() if " - loss: " in line]
    assert len(lines) == 2, lines  # one line per epoch
    for line in lines:
        assert " - val_loss: " in line and " - val_accuracy: " in line, line
        assert " - learning_rate: 0.0123" in line, line


def test_a_trainer_prints_the_start_line_fit_prints(two_towers, capsys):
    class SumTrainer(kt.Trainer):
        def run_step(self):
            return self.hooked_run(self.summed, self.next_batches())

        @kt.Trainer.tower_function(reduce="sum")
        def summed(self, batch):
            return {"sum": keras.ops.sum(batch)}

    def ones():
        while True:
            yield np.ones([3], "float32")

    if BACKEND == "tensorflow":
        # kt.Trainer on TensorFlow takes a kt.InputSource or a tf.data.Dataset
        # only (fit takes the generator); on JAX it takes the generator.
        import tensorflow as tf

        data = tf.data.Dataset.from_tensors(tf.ones([3])).repeat()
    else:
        data = ones()
    SumTrainer(None, data).train(steps_per_epoch=2, max_epoch=1, verbose=2)
    model = mlp()
    model.fit(_endless(batch=3), steps_per_epoch=2, epochs=1, verbose=2)
    starts = [line for line in capsys.readouterr().out.splitlines() if line.startswith("kerastower: ")]
    assert starts == ["kerastower: 2 tower(s) x 3 examples = total batch 6 per step"] * 2


def test_a_resumed_run_says_from_which_checkpoint_epoch_and_step(two_towers, tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    model = mlp()
    model.fit(_endless(), steps_per_epoch=3, epochs=1, verbose=0,
              callbacks=[kt.callbacks.ModelSaver(ckpt)])
    capsys.readouterr()
    resumed = mlp()
    resumed.fit(_endless(), steps_per_epoch=3, epochs=2, verbose=2,
                callbacks=[kt.callbacks.AutoResume(ckpt)])
    lines = [line for line in capsys.readouterr().out.splitlines() if "resumed from" in line]
    assert lines == [f"fit: resumed from {os.path.join(ckpt, 'ckpt-00000003')} (global step 3): "
                     "going on at epoch 2, step 0."]


def test_printers_and_time_left(two_towers, capsys):
    model = mlp()
    eta = kt.callbacks.EstimatedTimeLeft()
    model.fit(_endless(), steps_per_epoch=2, epochs=3, verbose=0,
              callbacks=[kt.callbacks.ScalarPrinter(whitelist=["loss"]), eta])
    out = capsys.readouterr().out
    assert out.count("] loss: ") == 3 and "[epoch 3, step 6] loss:" in out
    assert out.count("EstimatedTimeLeft:") == 2  # none after the last epoch
    assert len(eta.durations) == 3 and eta.estimate == 0


def test_peak_memory_tracker_adds_nothing_where_the_device_reports_nothing(two_towers):
    model = mlp()
    history = model.fit(_endless(), steps_per_epoch=1, verbose=0,
                        callbacks=[kt.callbacks.PeakMemoryTracker()])
    if BACKEND == "tensorflow":
        import tensorflow as tf

        has_gpu = bool(tf.config.list_logical_devices("GPU"))
    else:
        import jax

        has_gpu = any(d.platform == "gpu" for d in jax.devices())
    assert ("peak_memory_mb" in history.history) == has_gpu


def _scalar_steps(logdir, tag):
    return [step for step, _ in _events(logdir, tag)]


def test_tensorboard_steps_are_global_steps_across_executions_and_resumes(tmp_path):
    """With steps_per_execution=2 the batch hooks see steps 2, 3, 5, 6 of 2
    epochs x 3 steps; a resumed run goes on from the step it resumed at."""
    keras.utils.set_random_seed(1234)
    logdir, ckpt = str(tmp_path / "logs"), str(tmp_path / "ckpt")

    def run(epochs):
        with kt.distributed("mirrored", devices=tower_devices(2)):
            model = mlp(steps_per_execution=2)
            model.fit(_endless(), steps_per_epoch=3, epochs=epochs, verbose=0, logdir=logdir,
                      callbacks=[kt.callbacks.AutoResume(ckpt), kt.callbacks.ModelSaver(ckpt)])

    run(epochs=2)
    assert _scalar_steps(logdir, "batch_loss") == [2, 3, 5, 6]
    run(epochs=4)
    assert _scalar_steps(logdir, "batch_loss") == [2, 3, 5, 6, 8, 9, 11, 12]
    assert _scalar_steps(logdir, "epoch_loss") == [0, 1, 2, 3]


def test_tensorboard_update_freq_counts_global_steps(two_towers, tmp_path):
    """update_freq=2 writes at the calls that reach a multiple of 2 steps."""
    model = mlp(steps_per_execution=2)
    logdir = str(tmp_path / "tb")
    model.fit(_endless(), steps_per_epoch=3, epochs=2, verbose=0,
              callbacks=[kt.callbacks.TensorBoard(logdir, update_freq=2)])
    assert _scalar_steps(logdir, "batch_loss") == [2, 5, 6]


def test_optimizer_memory_is_read_from_every_tower_device():
    """Each tower's device holds the whole optimizer state where nothing is
    sharded (docs/sharded-optimizer.md): SGD with momentum, one slot the
    size of the weights, and two scalars."""
    with kt.distributed("mirrored", devices=tower_devices(2)):
        model = mlp(optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    x, y = id_data(16)
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0,
                        callbacks=[kt.callbacks.OptimizerMemoryTracker()])
    held = kt.optimizer_state_bytes(model)
    assert len(held) == 2
    weights = sum(w.nbytes for w in model.get_weights())
    scalars = sum(np.asarray(v.value).nbytes for v in model.optimizer.variables if len(v.shape) == 0)
    assert set(held.values()) == {weights + scalars}
    assert history.history["optimizer_state_mb"] == [(weights + scalars) / 2**20] * 2
