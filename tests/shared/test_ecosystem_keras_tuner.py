"""keras-tuner searches TowerModels inside `kt.distributed`, on both backends.

keras-tuner calls `keras.backend.clear_session()` before every trial's
build, which on TensorFlow used to drop the block's MirroredStrategy scope
(every trial failed, and leaving the block hid why). Here every trial
completes, and what the tuner records is what one device records:

- a trial of 2 towers x B examples logs the validation loss, and keeps the
  weights, of stock Keras on one device trained on the joined 2B batches;
- on 1 tower, those of stock Keras on B;
- `get_best_models` gives a trained TowerModel whose evaluation is the
  best trial's score (RandomSearch and Hyperband, whose later trials go on
  from an earlier trial's saved weights).
"""

import keras
import numpy as np
import pytest

import kerastower as kt

from tests.helpers.common import tower_devices

keras_tuner = pytest.importorskip("keras_tuner")

# keras-tuner 1.4 calls threading.currentThread().getName(), deprecated in Python 3.10.
pytestmark = pytest.mark.filterwarnings("ignore:.*(currentThread|getName).*:DeprecationWarning")

EPOCHS = 2
BATCH = 8


def _data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], "float32")).astype("float32")
    xv = rng.normal(size=(32, 4)).astype("float32")
    yv = (xv @ np.array([[1.0], [-2.0], [0.5], [0.0]], "float32")).astype("float32")
    return x, y, xv, yv


def _plain_model(hp):
    """A stock keras.Model for `hp`, its initial weights fixed by its seeds."""
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(hp.Choice("units", [4, 8]), activation="tanh",
                                kernel_initializer=keras.initializers.GlorotUniform(seed=1))(inputs)
    outputs = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2))(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(hp.Choice("learning_rate", [0.01, 0.05])),
                  loss="mse")
    return model


def _tower_model(hp):
    model = kt.TowerModel(_plain_model(hp))
    model.compile(optimizer=keras.optimizers.SGD(hp.get("learning_rate")), loss="mse")
    return model


class _WeightsEachEpoch(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append([np.array(w) for w in self.model.get_weights()])


def _one_device(hp, joined_batch):
    """Stock Keras on one device, trained as a trial is on `joined_batch`:
    its best validation loss and the weights of that epoch."""
    x, y, xv, yv = _data()
    model = _plain_model(hp)
    record = _WeightsEachEpoch()
    history = model.fit(x, y, batch_size=joined_batch, epochs=EPOCHS, shuffle=False,
                        validation_data=(xv, yv), verbose=0, callbacks=[record])
    best = int(np.argmin(history.history["val_loss"]))
    return history.history["val_loss"][best], record.weights[best]


def _search(tuner_class, num_towers, tmp_path, **tuner_kwargs):
    x, y, xv, yv = _data()
    with kt.distributed("mirrored", devices=tower_devices(num_towers)):
        tuner = tuner_class(_tower_model, objective="val_loss", directory=str(tmp_path),
                            project_name=tuner_class.__name__, overwrite=True, seed=5,
                            **tuner_kwargs)
        tuner.search(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                     validation_data=(xv, yv), verbose=0)
        best = tuner.get_best_models(1)[0]
    return tuner, best


@pytest.mark.parametrize("num_towers", [1, 2])
def test_random_search_trials_equal_one_device_on_the_joined_batch(num_towers, tmp_path):
    tuner, best = _search(keras_tuner.RandomSearch, num_towers, tmp_path, max_trials=2)
    trials = list(tuner.oracle.trials.values())
    assert len(trials) == 2 and all(t.status == "COMPLETED" for t in trials), (
        [(t.trial_id, t.status) for t in trials])
    for trial in trials:
        val_loss, _ = _one_device(trial.hyperparameters, BATCH * num_towers)
        np.testing.assert_allclose(trial.score, val_loss, rtol=1e-5, atol=1e-6)
    best_trial = tuner.oracle.get_best_trials(1)[0]
    _, weights = _one_device(best_trial.hyperparameters, BATCH * num_towers)
    assert isinstance(best, kt.TowerModel) and best.num_towers == num_towers
    for got, want in zip(best.get_weights(), weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_hyperband_completes_every_trial_and_the_best_model_scores_its_trial(tmp_path):
    tuner, best = _search(keras_tuner.Hyperband, 2, tmp_path, max_epochs=EPOCHS, factor=2,
                          hyperband_iterations=1)
    trials = list(tuner.oracle.trials.values())
    assert len(trials) >= 2 and all(t.status == "COMPLETED" for t in trials), (
        [(t.trial_id, t.status) for t in trials])
    _, _, xv, yv = _data()
    assert isinstance(best, kt.TowerModel) and best.num_towers == 2
    score = tuner.oracle.get_best_trials(1)[0].score
    np.testing.assert_allclose(best.evaluate(xv, yv, batch_size=BATCH, verbose=0), score,
                               rtol=1e-5, atol=1e-6)
