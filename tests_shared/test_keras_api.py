"""Keras's fit, evaluate and predict behave alike on both backends, on 2 towers.

Each test here once held on TensorFlow only: on JAX, evaluate and predict
took `callbacks` and `verbose` and ignored both (so did fit's validation),
`kt.TowerModel(keras_model)` and `from kerastower import *` failed.
"""

import numpy as np
import keras
import pytest

import kerastower as kt
from kerastower.backend.engine import StepEngine

from shared_helpers import BACKEND
from shared_helpers import two_towers  # noqa: F401  (a fixture)


def _data(n=48, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.integers(0, 3, n).astype("int32")
    return x, y


def _model():
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, activation="tanh")(inputs)
    model = kt.TowerModel(inputs, keras.layers.Dense(3)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


class HookLog(keras.callbacks.Callback):
    """Records every test and predict hook Keras would call, in order."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def on_test_begin(self, logs=None):
        self.calls.append("test_begin")

    def on_test_batch_begin(self, batch, logs=None):
        self.calls.append(f"test_batch_begin:{batch}")

    def on_test_batch_end(self, batch, logs=None):
        self.calls.append(f"test_batch_end:{batch}:{sorted(logs)}")

    def on_test_end(self, logs=None):
        self.calls.append(f"test_end:{sorted(logs)}")

    def on_predict_begin(self, logs=None):
        self.calls.append("predict_begin")

    def on_predict_batch_end(self, batch, logs=None):
        self.calls.append(f"predict_batch_end:{batch}:{logs['outputs'].shape[0]}")

    def on_predict_end(self, logs=None):
        self.calls.append("predict_end")


def test_evaluate_calls_the_callbacks_test_hooks(two_towers):
    x, y = _data(48)
    model = _model()
    log = HookLog()
    result = model.evaluate(x, y, batch_size=8, verbose=0, callbacks=[log], return_dict=True)
    # 48 examples, 2 towers x 8: 3 steps. (A batch_begin may come once more
    # before the input is found to end, as in Keras for inputs of unknown length.)
    assert [c for c in log.calls if not c.startswith("test_batch_begin")] == [
        "test_begin",
        "test_batch_end:0:['accuracy', 'loss']",
        "test_batch_end:1:['accuracy', 'loss']",
        "test_batch_end:2:['accuracy', 'loss']",
        "test_end:['accuracy', 'loss']",
    ]
    assert log.calls[1:6:2] == ["test_batch_begin:0", "test_batch_begin:1", "test_batch_begin:2"]
    assert set(result) == {"accuracy", "loss"}


def test_predict_calls_the_callbacks_predict_hooks(two_towers):
    x, _ = _data(40)
    model = _model()
    log = HookLog()
    out = model.predict(x, batch_size=8, verbose=0, callbacks=[log])
    # 40 examples, 2 towers x 8: two whole steps, then one tower's 8 examples.
    assert log.calls == ["predict_begin", "predict_batch_end:0:16", "predict_batch_end:1:16",
                         "predict_batch_end:2:8", "predict_end"]
    assert out.shape == (40, 3)


def test_fit_validation_calls_the_callbacks_test_hooks(two_towers):
    x, y = _data(32)
    model = _model()
    log = HookLog()
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[log],
                        validation_data=(x, y))
    assert log.calls.count("test_begin") == 2
    assert log.calls.count("test_end:['accuracy', 'loss']") == 2
    assert sorted(history.history) == ["accuracy", "loss", "val_accuracy", "val_loss"]


def test_evaluate_and_predict_print_a_progress_bar_unless_verbose_0(two_towers, capsys):
    x, y = _data(32)
    model = _model()
    model.evaluate(x, y, batch_size=8, verbose=0)
    model.predict(x, batch_size=8, verbose=0)
    assert capsys.readouterr().out == ""
    model.evaluate(x, y, batch_size=8, verbose=1)
    assert "loss" in capsys.readouterr().out
    model.predict(x, batch_size=8, verbose=1)
    assert "2/2" in capsys.readouterr().out


def test_stop_evaluating_from_a_callback_ends_evaluate(two_towers):
    x, y = _data(64)
    model = _model()

    class StopAfterFirst(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            self.model.stop_evaluating = True

    log = HookLog()
    model.evaluate(x, y, batch_size=8, verbose=0, callbacks=[StopAfterFirst(), log])
    assert [c for c in log.calls if c.startswith("test_batch_end")] == [
        "test_batch_end:0:['accuracy', 'loss']"]


def test_tower_model_around_a_keras_model_shares_its_weights(two_towers):
    x, y = _data(32)
    keras_model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    before = keras_model.get_weights()
    model = kt.TowerModel(keras_model)
    assert isinstance(model, kt.TowerModel)
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    after = keras_model.get_weights()
    assert not np.allclose(before[0], after[0])
    for shared, own in zip(after, model.get_weights()):
        np.testing.assert_array_equal(shared, own)


def test_star_import_gives_the_public_api():
    namespace = {}
    exec("from kerastower import *", namespace)
    assert namespace["TowerModel"] is kt.TowerModel
    assert namespace["distributed"] is kt.distributed
    expected = set(kt.__all__)
    assert expected <= set(namespace)


def test_one_tower_model_class_and_one_engine_interface(two_towers):
    import kerastower.model

    assert kt.TowerModel is kerastower.model.TowerModel
    for method in ("fit", "evaluate", "predict", "compile"):
        assert getattr(kt.TowerModel, method).__module__ == "kerastower.model", method
    model = _model()
    assert isinstance(model.engine, StepEngine)
    assert type(model.engine).__module__ == f"kerastower.backend.{BACKEND}.engine"


@pytest.mark.parametrize("method", ["evaluate", "predict"])
def test_an_empty_input_raises_on_every_backend(two_towers, method):
    model = _model()
    x, y = _data(0)
    args = (x, y) if method == "evaluate" else (x,)
    with pytest.raises(kt.InputSourceError, match=f"{method}\\(\\) got no batch"):
        getattr(model, method)(*args, batch_size=8, verbose=0)


def test_peak_memory_tracker_and_collectives_say_what_they_can(two_towers):
    """Neither reaches for TensorFlow on JAX (PeakMemoryTracker imported it;
    collectives_per_step raised AttributeError)."""
    x, y = _data(32)
    model = _model()
    history = model.fit(x, y, batch_size=8, verbose=0, callbacks=[kt.callbacks.PeakMemoryTracker()])
    assert "peak_memory_mb" not in history.history   # CPUs report no memory
    if BACKEND == "tensorflow":
        assert set(kt.collectives_per_step(model)) == {"step", "logs"}
    else:
        with pytest.raises(kt.KerasTowerError, match="collectives_per_step.*HLO"):
            kt.collectives_per_step(model)
