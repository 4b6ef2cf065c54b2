"""What Keras's fit takes and does, the same on both backends, on 2 towers."""

import os

import keras
import numpy as np
import pytest

import kerastower as kt

from tests.helpers.common import tower_devices


def _data(n=48, seed=0, classes=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.integers(0, classes, n).astype("int32")
    return x, y


def _model(metrics=("accuracy",), lr=0.1):
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    model = kt.TowerModel(inputs, keras.layers.Dense(3)(h))
    model.compile(optimizer=keras.optimizers.SGD(lr),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=list(metrics))
    return model


def test_initial_epoch_and_validation_freq(two_towers):
    x, y = _data(32)
    model = _model()
    seen = []

    class Epochs(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append((epoch, sorted(logs)))

    history = model.fit(x, y, batch_size=8, initial_epoch=1, epochs=4, verbose=0,
                        validation_data=(x, y), validation_freq=2, callbacks=[Epochs()])
    assert history.epoch == [1, 2, 3]
    # Keras's rule: validate when (epoch + 1) % freq == 0, epochs 0-based.
    assert [e for e, keys in seen if "val_loss" in keys] == [1, 3]
    assert len(history.history["loss"]) == 3
    assert model.loop.global_step == 3 * 2   # 32 examples, 2 towers x 8


def test_class_weight_equals_the_sample_weights_it_stands_for():
    x, y = _data(32)
    weights = {0: 1.0, 1: 2.0, 2: 0.5}
    results = []
    for kwargs in ({"class_weight": weights},
                   {"sample_weight": np.array([weights[int(c)] for c in y], "float32")}):
        keras.utils.set_random_seed(7)
        with kt.distributed("mirrored", devices=tower_devices(2)):
            model = _model()
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, **kwargs)
        results.append(model.get_weights())
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_evaluate_as_a_list_follows_metrics_names(two_towers):
    x, y = _data(32)
    model = _model(metrics=("accuracy", keras.metrics.SparseCategoricalCrossentropy(
        from_logits=True, name="xent")))
    as_dict = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    as_list = model.evaluate(x, y, batch_size=8, verbose=0)
    assert len(as_list) == 3 and as_list[0] == pytest.approx(as_dict["loss"])
    assert sorted(as_dict) == ["accuracy", "loss", "xent"]
    # The loss is the cross-entropy here: both say the same.
    assert as_dict["xent"] == pytest.approx(as_dict["loss"], abs=1e-5)


@pytest.mark.parametrize("rows", [21, 25])
def test_predict_keeps_the_input_order_and_dict_outputs(two_towers, rows):
    # 21 rows, 2 towers x 4: 2 whole steps, then 5 rows (6 batches: every
    # step gives each tower one, the steps' fast path on TensorFlow); 25
    # rows: 7 batches, the last step gives tower 1 none.
    x = np.arange(2 * rows, dtype="float32").reshape(rows, 2)
    inputs = keras.Input((2,))
    model = kt.TowerModel(inputs, {"same": keras.layers.Identity()(inputs),
                                   "twice": keras.layers.Rescaling(2.0)(inputs)})
    out = model.predict(x, batch_size=4, verbose=0)
    np.testing.assert_array_equal(out["same"], x)
    np.testing.assert_array_equal(out["twice"], 2 * x)


def test_steps_per_epoch_takes_that_many_steps_from_an_endless_generator(two_towers):
    x, y = _data(64)
    taken = []

    def batches():
        i = 0
        while True:
            rows = slice((8 * i) % 64, (8 * i) % 64 + 8)
            taken.append(i)
            yield x[rows], y[rows]
            i += 1

    model = _model()
    history = model.fit(batches(), steps_per_epoch=3, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    assert model.loop.global_step == 6
    assert len(taken) >= 12   # every step took one batch per tower


def test_early_stopping_ends_training(two_towers):
    x, y = _data(32)
    model = _model(lr=0.0)   # nothing improves
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=1.0)
    history = model.fit(x, y, batch_size=8, epochs=10, verbose=0, callbacks=[stop])
    assert len(history.history["loss"]) == 2


def test_model_checkpoint_file_loads_back_as_a_tower_model(two_towers, tmp_path):
    x, y = _data(32)
    model = _model()
    path = os.path.join(tmp_path, "model.keras")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0,
              callbacks=[keras.callbacks.ModelCheckpoint(path)])
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, kt.TowerModel)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)


def test_dict_inputs(two_towers):
    rng = np.random.default_rng(0)
    data = {"a": rng.normal(size=(32, 3)).astype("float32"),
            "b": rng.normal(size=(32, 2)).astype("float32")}
    y = rng.normal(size=(32, 1)).astype("float32")
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    model = kt.TowerModel({"a": a, "b": b},
                          keras.layers.Dense(1)(keras.layers.Concatenate()([a, b])))
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(data, y, batch_size=8, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2
    assert model.predict(data, batch_size=8, verbose=0).shape == (32, 1)
