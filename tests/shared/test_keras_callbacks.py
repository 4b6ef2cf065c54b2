"""Stock Keras callbacks behave as documented under TowerModel with 2 towers."""

import csv
import os

import keras
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util

import kerastower as kt

from tests.helpers.common import id_data
from tests.helpers.common import mlp
from tests.helpers.common import tower_copies
from tests.helpers.common import tower_devices


def _xy(n=64):
    x, y = id_data(n)
    x[:, 0] = 0.0
    return x, y


def test_model_checkpoint_saves_a_model_that_loads_and_predicts_the_same(two_towers, tmp_path):
    x, y = _xy()
    model = mlp()
    path = str(tmp_path / "epoch{epoch}.keras")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0,
              callbacks=[keras.callbacks.ModelCheckpoint(path)])
    assert sorted(os.listdir(tmp_path)) == ["epoch1.keras", "epoch2.keras"]
    restored = keras.models.load_model(str(tmp_path / "epoch2.keras"))
    assert isinstance(restored, kt.TowerModel)
    np.testing.assert_allclose(restored.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
    # It comes back compiled, optimizer state included, and trains on.
    assert restored.optimizer.iterations.numpy() == model.optimizer.iterations.numpy()
    assert restored.evaluate(x, y, verbose=0, return_dict=True)["loss"] == pytest.approx(
        model.evaluate(x, y, verbose=0, return_dict=True)["loss"], rel=1e-5)
    restored.fit(x, y, batch_size=8, verbose=0)


def test_model_checkpoint_best_only_weights(two_towers, tmp_path):
    x, y = _xy()
    model = mlp()
    path = str(tmp_path / "best.weights.h5")
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, validation_data=(x, y),
              callbacks=[keras.callbacks.ModelCheckpoint(path, save_weights_only=True,
                                                         save_best_only=True, monitor="val_loss")])
    assert os.path.exists(path)


def test_early_stopping_stops_and_restores_best_weights(two_towers):
    x, y = _xy()
    model = mlp(optimizer=keras.optimizers.SGD(0.0))  # nothing improves
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=2, min_delta=0.01)
    history = model.fit(x, y, batch_size=8, epochs=20, verbose=0, callbacks=[stop])
    assert len(history.history["loss"]) == 3
    assert stop.stopped_epoch == 2


def test_reduce_lr_on_plateau_lowers_the_learning_rate_on_every_tower(two_towers):
    x, y = _xy()
    model = mlp(optimizer=keras.optimizers.SGD(1e-9))  # too small for the loss to improve
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=1,
                                                min_delta=0.01, min_lr=0.0)
    model.fit(x, y, batch_size=8, epochs=4, verbose=0, callbacks=[plateau])
    copies = tower_copies(model.optimizer._learning_rate)
    # Two on TensorFlow; on JAX one, until the next step replicates it, when
    # it was set after the last step.
    assert copies and all(c == pytest.approx(1e-9 / 2**3, rel=1e-3) for c in copies)


def test_learning_rate_scheduler(two_towers):
    x, y = _xy()
    model = mlp()
    seen = []
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 * (epoch + 1))
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda e, logs: seen.append(round(float(model.optimizer.learning_rate.numpy()), 6)))
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[schedule, record])
    assert seen == [0.1, 0.2, 0.3]


def test_terminate_on_nan(two_towers):
    x, y = _xy()
    x[:8, 1] = np.inf  # the first step's batches
    model = mlp()
    history = model.fit(x, y, batch_size=4, epochs=3, verbose=0, shuffle=False,
                        callbacks=[keras.callbacks.TerminateOnNaN()])
    assert model.stop_training
    assert len(history.history.get("loss", [])) <= 1
    # kerastower skipped the non-finite update: the weights stay finite.
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_csv_logger_and_tensorboard(two_towers, tmp_path):
    x, y = _xy()
    model = mlp()
    csv_path = str(tmp_path / "log.csv")
    logdir = str(tmp_path / "tb")
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, validation_data=(x, y),
              callbacks=[keras.callbacks.CSVLogger(csv_path),
                         keras.callbacks.TensorBoard(logdir, update_freq="batch")])
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(rows[0])
    scalars = _scalars(os.path.join(logdir, "train"))
    assert "epoch_loss" in scalars and "batch_loss" in scalars
    epoch_losses = scalars["epoch_loss"]
    np.testing.assert_allclose(epoch_losses, [float(r["loss"]) for r in rows], rtol=1e-5)


def _scalars(folder):
    """{tag: values} of the event files in `folder`: summaries written as
    tensors (tf.summary) or as scalars (the JAX backend's writer)."""
    accumulator = event_accumulator.EventAccumulator(folder)
    accumulator.Reload()
    out = {tag: [tensor_util.make_ndarray(e.tensor_proto).item() for e in accumulator.Tensors(tag)]
           for tag in accumulator.Tags()["tensors"]}
    out.update({tag: [e.value for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]})
    return out


def test_backup_and_restore_resumes_at_the_interrupted_epoch(tmp_path):
    keras.utils.set_random_seed(1234)
    x, y = _xy()
    backup_dir = str(tmp_path / "backup")

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    with kt.distributed("mirrored", devices=tower_devices(2)):
        model = mlp()
        with pytest.raises(RuntimeError, match="interrupted"):
            model.fit(x, y, batch_size=8, epochs=4, verbose=0,
                      callbacks=[keras.callbacks.BackupAndRestore(backup_dir), Interrupt()])
    with kt.distributed("mirrored", devices=tower_devices(2)):
        resumed = mlp()
        epochs_run = []
        record = keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: epochs_run.append(e))
        resumed.fit(x, y, batch_size=8, epochs=4, verbose=0,
                    callbacks=[keras.callbacks.BackupAndRestore(backup_dir), record])
    assert epochs_run == [2, 3]
    assert resumed.optimizer.iterations.numpy() == 4 * 4
