"""A resume restores the callbacks' state: it ends where the uninterrupted run ends (issue 55).

EarlyStopping(restore_best_weights=True), ReduceLROnPlateau,
ModelCheckpoint(save_best_only=True) and kerastower's MinSaver decide from
what they saw in earlier epochs. A run stopped anywhere (a preemption signal
mid-epoch, a crash mid-epoch that resumes from the last epoch's checkpoint)
and resumed by AutoResume must stop at the same epoch, with the same
learning rate, the same best values and bit-equal weights as the run never
stopped, on 2 towers, on each backend.
"""


import keras
import numpy as np
import pytest

from tests.helpers.common import SigtermAt
from tests.helpers.common import Stop
from tests.helpers.common import StopAt
from tests.helpers.common import tower_devices

import kerastower as kt

# Its module-scoped fixture starts processes once: one pytest-xdist worker runs the module.
pytestmark = pytest.mark.xdist_group("test_resume_callback_state")

STEPS = 4  # steps an epoch: 32 examples, 2 towers x 4


def _data():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(32, 3)).astype("float32")
    y = (x @ np.array([[0.5], [-1.0], [2.0]], "float32")).astype("float32")
    y += rng.normal(scale=0.3, size=y.shape).astype("float32")
    # Validation targets unlike the training ones: val_loss soon rises, so
    # ReduceLROnPlateau and EarlyStopping act within a few epochs.
    x_val = rng.normal(size=(16, 3)).astype("float32")
    y_val = rng.normal(size=(16, 1)).astype("float32")
    return x, y, x_val, y_val


def _model():
    """The same model and initial weights on 2 towers, each time."""
    keras.utils.set_random_seed(7)
    with kt.distributed("mirrored", devices=tower_devices(2)):
        inputs = keras.Input((3,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.5), loss="mse")
    return model


def _fit(folder, stop=None):
    """A fresh model and callbacks, fit to the end (or to `stop`); returns
    (model, its callbacks by kind)."""
    model = _model()
    named = {
        "early": keras.callbacks.EarlyStopping(monitor="val_loss", patience=3,
                                               restore_best_weights=True),
        "plateau": keras.callbacks.ReduceLROnPlateau(monitor="val_loss", patience=1, factor=0.5),
        "best": keras.callbacks.ModelCheckpoint(str(folder / "best.keras"), monitor="val_loss",
                                                save_best_only=True),
        "min": kt.callbacks.MinSaver("val_loss", checkpoint_dir=str(folder / "min")),
    }
    ckpt = str(folder / "ckpt")
    callbacks = ([kt.callbacks.AutoResume(ckpt), kt.callbacks.ModelSaver(ckpt)]
                 + list(named.values()) + ([] if stop is None else [stop]))
    x, y, x_val, y_val = _data()
    model.fit(x, y, batch_size=4, epochs=30, shuffle=False, verbose=0,
              validation_data=(x_val, y_val), callbacks=callbacks)
    return model, named


def _outcome(model, named):
    early, plateau = named["early"], named["plateau"]
    return {
        "weights": model.get_weights(),
        "global_step": model.loop.global_step,
        "learning_rate": float(np.asarray(model.optimizer.learning_rate)),
        "stopped_epoch": early.stopped_epoch,
        "early_best": early.best,
        "best_epoch": early.best_epoch,
        "plateau": (plateau.wait, plateau.cooldown_counter, plateau.best),
        "checkpoint_best": named["best"].best,
        "min_best": named["min"].best,
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    outcome = _outcome(*_fit(tmp_path_factory.mktemp("uninterrupted")))
    # The premise: the callbacks acted before the run ended, and it stopped early.
    assert 1 <= outcome["best_epoch"] and outcome["stopped_epoch"] == outcome["best_epoch"] + 3, outcome
    assert outcome["learning_rate"] < 0.1, outcome
    return outcome


def _assert_same(got, want):
    for a, b in zip(got.pop("weights"), want["weights"]):
        np.testing.assert_array_equal(a, b)
    assert got == {k: v for k, v in want.items() if k != "weights"}


@pytest.mark.parametrize("when", ["waiting after the best epoch", "in the last epoch"])
def test_preempted_mid_epoch_and_resumed_ends_as_the_run_never_stopped(tmp_path, uninterrupted, when):
    # Epochs 1-based: the best epoch is `best_epoch + 1`; EarlyStopping
    # waits after it, and stops in epoch `stopped_epoch + 1`.
    epoch = (uninterrupted["best_epoch"] + 2 if when.startswith("waiting")
             else uninterrupted["stopped_epoch"] + 1)
    with pytest.raises(kt.Preempted):
        _fit(tmp_path, stop=SigtermAt((epoch - 1) * STEPS + 2))
    _assert_same(_outcome(*_fit(tmp_path)), uninterrupted)


def test_crashed_and_resumed_from_an_epoch_end_checkpoint_ends_as_the_run_never_stopped(
        tmp_path, uninterrupted):
    # Crashed in the epoch after the next one after the best: resumes from the
    # checkpoint of the epoch after the best one, with what each callback saw there.
    epoch = uninterrupted["best_epoch"] + 3
    with pytest.raises(Stop):
        _fit(tmp_path, stop=StopAt((epoch - 1) * STEPS + 2))
    _assert_same(_outcome(*_fit(tmp_path)), uninterrupted)


def test_a_checkpoint_state_no_callback_takes_is_said(tmp_path, uninterrupted):
    with pytest.raises(kt.Preempted):
        _fit(tmp_path, stop=SigtermAt(5))
    model = _model()
    x, y, x_val, y_val = _data()
    with pytest.warns(UserWarning, match="EarlyStopping.*not restored"):
        model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0,
                  validation_data=(x_val, y_val),
                  callbacks=[kt.callbacks.AutoResume(str(tmp_path / "ckpt"))])
