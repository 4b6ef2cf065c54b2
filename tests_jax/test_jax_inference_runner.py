"""kt.callbacks.InferenceRunner on JAX: exact over the towers (every example
once, a short last step included), from arrays or a PyDataset, and an
evaluation in the middle of an epoch leaves the training logs alone."""

import keras
import numpy as np
import pytest

import kerastower as kt


def _data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32") + (x[:, 2] > 1).astype("int32")
    return x, y, rng.uniform(0.5, 2.0, n).astype("float32")


def _model():
    keras.utils.set_random_seed(2)
    with kt.distributed("mirrored", devices=[0, 1]):
        inputs = keras.Input((4,))
        h = keras.layers.Dense(8, activation="relu")(inputs)
        model = kt.TowerModel(inputs, keras.layers.Dense(3)(h))
        model.compile(optimizer=keras.optimizers.Adam(1e-2), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _fit(callbacks):
    x, y, _ = _data(96, 0)
    model = _model()
    keras.utils.set_random_seed(3)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=callbacks)
    return model, history.history


def test_results_are_exact_over_the_towers():
    xv, yv, wv = _data(50, 1)   # 7 a tower: 3 whole steps and a short one of 8
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
    xv, yv, _ = _data(40, 1)

    class Validation(keras.utils.PyDataset):
        def __len__(self):
            return 5

        def __getitem__(self, i):
            return xv[8 * i:8 * i + 8], yv[8 * i:8 * i + 8]

    runner = kt.callbacks.InferenceRunner(Validation(), [kt.callbacks.ClassificationError()])
    model, history = _fit([runner])
    wrong = np.argmax(model.predict(xv, batch_size=40, verbose=0), axis=-1) != yv
    assert history["val_error"][-1] == pytest.approx(float(wrong.mean()), abs=1e-6)


def test_a_mid_epoch_evaluation_leaves_the_training_logs_alone():
    _, plain = _fit([])
    xv, yv, _ = _data(30, 1)
    runner = kt.callbacks.InferenceRunner((xv, yv), [kt.callbacks.ScalarStats(["loss"])], batch_size=5)
    _, with_runner = _fit([kt.callbacks.PeriodicTrigger(runner, every_k_steps=2)])
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(with_runner[key], plain[key], atol=1e-6)
    assert set(runner.results) == {"val_loss"}   # it ran; mid-epoch, into that step's logs


def test_class_indices_of_shape_n_by_1_are_labels_not_one_hot():
    xv, yv, _ = _data(40, 1)
    runner = kt.callbacks.InferenceRunner((xv, yv[:, None]), [kt.callbacks.ClassificationError()])
    model, history = _fit([runner])
    wrong = np.argmax(model.predict(xv, batch_size=40, verbose=0), axis=-1) != yv
    assert history["val_error"][-1] == pytest.approx(float(wrong.mean()), abs=1e-6)
