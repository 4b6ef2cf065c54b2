"""InferenceRunner on both backends: several sources, data-parallel, exact
as one device (every example once, a short last step included), from arrays
or a PyDataset; an evaluation in the middle of an epoch leaves the training
logs alone."""

import keras
import numpy as np
import pytest

import kerastower as kt

from tests.helpers.common import id_data
from tests.helpers.common import tower_devices

TWO = tower_devices(2)


def _model(weights=None):
    keras.utils.set_random_seed(11)
    inputs = keras.Input((4,))
    model = kt.TowerModel(inputs, keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.0), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if weights is not None:
        model.set_weights(weights)
    return model


def test_runners_on_two_sources_equal_a_one_device_evaluation():
    x, y = id_data(64)
    x[:, 0] = 0.0
    val_a, val_b = id_data(37, seed=1), id_data(23, seed=2)
    for v in (val_a, val_b):
        v[0][:, 0] = 0.0
    weights = _model().get_weights()

    one = _model(weights)
    expected = {}
    for prefix, (vx, vy) in (("a", val_a), ("b", val_b)):
        logits = one.predict(vx, batch_size=64, verbose=0)
        expected[f"{prefix}_error"] = float(np.mean(np.argmax(logits, -1) != vy))
        result = one.evaluate(vx, vy, batch_size=64, verbose=0, return_dict=True)
        expected[f"{prefix}_loss"] = result["loss"]
        expected[f"{prefix}_accuracy"] = result["accuracy"]

    with kt.distributed("mirrored", devices=TWO):
        model = _model(weights)
        runners = [
            kt.callbacks.InferenceRunner(
                (vx, vy), [kt.callbacks.ScalarStats(["loss", "accuracy"], prefix=prefix),
                           kt.callbacks.ClassificationError(f"{prefix}_error")], batch_size=5)
            for prefix, (vx, vy) in (("a", val_a), ("b", val_b))
        ]
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=runners)
    for key, value in expected.items():
        assert history.history[key] == pytest.approx([value, value], abs=1e-6), key
    assert expected["a_error"] == pytest.approx(1 - expected["a_accuracy"], abs=1e-6)


def test_classification_error_with_one_hot_labels_and_weights(two_towers):
    x, y = id_data(30)
    x[:, 0] = 0.0
    model = _model()
    logits = model.predict(x, batch_size=30, verbose=0)
    weights = np.linspace(0.0, 2.0, 30).astype("float32")
    wrong = (np.argmax(logits, -1) != y).astype("float64")
    runner = kt.callbacks.InferenceRunner(
        (x, np.eye(3, dtype="float32")[y], weights), [kt.callbacks.ClassificationError()], batch_size=4)
    runner.set_model(model)
    runner.trigger()
    assert runner.results["val_error"] == pytest.approx((wrong * weights).sum() / weights.sum(), rel=1e-6)


def test_bad_inferencers_are_refused(two_towers):
    x, y = id_data(8)
    with pytest.raises(TypeError, match="takes kt.callbacks.Inferencer objects"):
        kt.callbacks.InferenceRunner((x, y), ["accuracy"])
    model = _model()
    runner = kt.callbacks.InferenceRunner((x, y), [kt.callbacks.ScalarStats(["f1"])])
    with pytest.raises(KeyError, match="'f1' is not a metric of the model"):
        model.fit(x, y, batch_size=4, verbose=0, callbacks=[runner])


def test_a_mid_epoch_runner_leaves_the_training_logs_as_they_were():
    """evaluate resets the metrics; the runner puts the training metrics of
    every tower back, so the epoch's logs are those of training alone."""
    x, y = id_data(48)
    x[:, 0] = 0.0
    val_x, val_y = id_data(20, seed=4)
    val_x[:, 0] = 0.0
    weights = _model().get_weights()

    def fit(callbacks):
        with kt.distributed("mirrored", devices=TWO):
            model = _model(weights)
            model.optimizer.learning_rate.assign(0.1)
            seen = []
            probe = keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda batch, logs: seen.append(sorted(logs)))
            history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False,
                                callbacks=callbacks + [probe])
        return history.history, seen

    runner = kt.callbacks.InferenceRunner(
        (val_x, val_y), [kt.callbacks.ScalarStats(["loss", "accuracy"])], batch_size=4)
    alone, _ = fit([])
    with_runner, seen = fit([kt.callbacks.PeriodicTrigger(runner, every_k_steps=4)])
    for key in ("loss", "accuracy"):
        assert with_runner[key] == pytest.approx(alone[key], abs=1e-6), key
    # 6 steps an epoch: the runner ran after steps 4, 8 and 12, mid-epoch twice.
    assert [i for i, keys in enumerate(seen) if "val_loss" in keys] == [3, 7, 11]


# From tests/jax/test_jax_inference_runner.py: an Adam model trained 2 epochs.

def _labelled(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32") + (x[:, 2] > 1).astype("int32")
    return x, y, rng.uniform(0.5, 2.0, n).astype("float32")


def _adam_model():
    keras.utils.set_random_seed(2)
    with kt.distributed("mirrored", devices=TWO):
        inputs = keras.Input((4,))
        h = keras.layers.Dense(8, activation="relu")(inputs)
        model = kt.TowerModel(inputs, keras.layers.Dense(3)(h))
        model.compile(optimizer=keras.optimizers.Adam(1e-2), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _fit(callbacks):
    x, y, _ = _labelled(96, 0)
    model = _adam_model()
    keras.utils.set_random_seed(3)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks)
    return model, history.history


def test_results_are_exact_over_the_towers():
    xv, yv, wv = _labelled(50, 1)   # 7 a tower: 3 whole steps and a short one of 8
    runner = kt.callbacks.InferenceRunner(
        (xv, yv, wv), [kt.callbacks.ScalarStats(["loss", "accuracy"]), kt.callbacks.ClassificationError()],
        batch_size=7)
    model, history = _fit([runner])
    evaluated = model.evaluate(xv, yv, sample_weight=wv, batch_size=25, verbose=0, return_dict=True)
    assert history["val_loss"][-1] == pytest.approx(evaluated["loss"], abs=1e-5)
    assert history["val_accuracy"][-1] == pytest.approx(evaluated["accuracy"], abs=1e-5)
    wrong = np.argmax(model.predict(xv, batch_size=50, verbose=0), axis=-1) != yv
    assert history["val_error"][-1] == pytest.approx(float((wrong * wv).sum() / wv.sum()), abs=1e-6)
    assert 0 < history["val_error"][-1] < 1


def test_a_pydataset_source():
    xv, yv, _ = _labelled(40, 1)

    class Validation(keras.utils.PyDataset):
        def __len__(self):
            return 5

        def __getitem__(self, i):
            return xv[8 * i:8 * i + 8], yv[8 * i:8 * i + 8]

    runner = kt.callbacks.InferenceRunner(Validation(), [kt.callbacks.ClassificationError()])
    model, history = _fit([runner])
    wrong = np.argmax(model.predict(xv, batch_size=40, verbose=0), axis=-1) != yv
    assert history["val_error"][-1] == pytest.approx(float(wrong.mean()), abs=1e-6)


def test_class_indices_of_shape_n_by_1_are_labels_not_one_hot():
    xv, yv, _ = _labelled(40, 1)
    runner = kt.callbacks.InferenceRunner((xv, yv[:, None]), [kt.callbacks.ClassificationError()])
    model, history = _fit([runner])
    wrong = np.argmax(model.predict(xv, batch_size=40, verbose=0), axis=-1) != yv
    assert history["val_error"][-1] == pytest.approx(float(wrong.mean()), abs=1e-6)
