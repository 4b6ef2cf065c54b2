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

from tests.helpers.common import BACKEND
from tests.helpers.common import tower_devices


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


class ZeroKernelAfterFirstStep(keras.callbacks.Callback):
    """Sets the last layer's kernel to zeros after the first test and
    predict step."""

    def _zero(self, batch):
        if batch == 0:
            kernel = self.model.layers[-1].kernel
            kernel.assign(np.zeros(kernel.shape, "float32"))

    def on_test_batch_end(self, batch, logs=None):
        self._zero(batch)

    def on_predict_batch_end(self, batch, logs=None):
        self._zero(batch)


def _ones_model(model_class):
    inputs = keras.Input((3,))
    model = model_class(inputs, keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")(inputs))
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_a_weight_a_callback_sets_mid_evaluation_is_used_by_the_next_steps():
    # The evaluation and prediction steps place the variables once, and
    # again where a callback set one (backend/jax/tower_state.py).
    x, y = np.ones((16, 3), "float32"), np.zeros((16, 1), "float32")
    towers = 2
    expected_loss = _ones_model(keras.Model).evaluate(
        x, y, batch_size=4 * towers, verbose=0, callbacks=[ZeroKernelAfterFirstStep()])
    expected_outputs = _ones_model(keras.Model).predict(
        x, batch_size=4 * towers, verbose=0, callbacks=[ZeroKernelAfterFirstStep()])
    with kt.distributed("mirrored", devices=tower_devices(towers)):
        model = _ones_model(kt.TowerModel)
        loss = model.evaluate(x, y, batch_size=4, verbose=0, callbacks=[ZeroKernelAfterFirstStep()])
        model = _ones_model(kt.TowerModel)
        outputs = model.predict(x, batch_size=4, verbose=0, callbacks=[ZeroKernelAfterFirstStep()])
    # The first step's examples (one batch per tower) at 3**2, the others at 0.
    assert loss == pytest.approx(9.0 * 4 * towers / 16) == pytest.approx(expected_loss)
    np.testing.assert_array_equal(outputs, expected_outputs)
    assert outputs[:4 * towers].tolist() == [[3.0]] * (4 * towers) and not outputs[4 * towers:].any()


class MetricsSeen(keras.callbacks.Callback):
    """Records the model's metric results after every test step."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_test_batch_end(self, batch, logs=None):
        self.seen.append({k: float(v) for k, v in self.model.get_metrics_result().items()})


def test_a_callback_reads_the_metrics_of_each_evaluation_step_as_in_keras():
    # On JAX the steps' metric sums reach the model's variables when a
    # callback reads `self.model`, not at every step.
    x, y = _data(32)
    expected = MetricsSeen()
    keras.utils.set_random_seed(3)
    stock = _model()
    stock = keras.Model(stock.inputs, stock.outputs)
    stock.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    stock.evaluate(x, y, batch_size=8, verbose=0, callbacks=[expected])
    seen = MetricsSeen()
    with kt.distributed("single", devices=tower_devices(1)):
        model = kt.TowerModel(stock.inputs, stock.outputs)
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        model.evaluate(x, y, batch_size=8, verbose=0, callbacks=[seen])
        final = {k: float(v) for k, v in model.get_metrics_result().items()}
    assert len(seen.seen) == 4
    for ours, theirs in zip(seen.seen, expected.seen):
        assert ours == pytest.approx(theirs, abs=1e-6)
    assert final == pytest.approx(expected.seen[-1], abs=1e-6)


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
