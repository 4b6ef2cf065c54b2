"""The step engine's edges on TensorFlow. (fit and kt.Trainer running one
loop, the same hooks in the same order, and kt.Trainer without a model, are
tested on both backends in tests/shared/test_trainers.py.)"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerastower as kt
from tests.tensorflow.helpers import TWO


def test_a_step_loss_scaling_skips_still_counts_as_a_global_step():
    towers = kt.distributed("mirrored", devices=TWO)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with towers:
            inputs = keras.Input((2,))
            model = kt.TowerModel(inputs, keras.layers.Dense(1, dtype="float32")(inputs))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    with towers:
        # A loss scale that overflows float16 gradients: the first steps are
        # skipped while the scale comes down.
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.1), initial_scale=2.0**40), loss="mse")
        model.fit(np.ones((64, 2), "float32") * 100, np.ones((64, 1), "float32"),
                  batch_size=4, epochs=1, verbose=0)
    assert model.loop.global_step == 8
    assert model.optimizer.iterations.numpy() < 8


class SecondOptimizerModel(kt.TowerModel):
    """A model whose second part trains with an optimizer of its own, which
    nothing builds before the first step."""

    def __init__(self, second_optimizer):
        super().__init__()
        self.a = keras.layers.Dense(1, name="a")
        self.b = keras.layers.Dense(1, name="b")
        self.b_optimizer = second_optimizer

    def call(self, x):
        return self.a(x) + self.b(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_mean((self(x) - y) ** 2)
        self.optimizer.apply(tape.gradient(loss, self.a.trainable_variables), self.a.trainable_variables)
        self.b_optimizer.apply(tape.gradient(loss, self.b.trainable_variables), self.b.trainable_variables)
        return {"loss": loss}


def test_a_second_optimizer_builds_on_first_use_outside_the_towers():
    with kt.distributed("mirrored", devices=TWO):
        model = SecondOptimizerModel(keras.optimizers.SGD(0.1))
        model.compile(optimizer="sgd", loss="mse")
        x, y = np.ones((16, 2), "float32"), np.ones((16, 1), "float32")
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
        before = model.b.kernel.numpy().copy()
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    # Built once, on the variables its first apply named, as in stock Keras:
    # SGD has no slots, only its step counter, which counts the 2 x 2 steps.
    assert model.b_optimizer.built
    assert [v.path for v in model.b_optimizer._trainable_variables] == [
        v.path for v in model.b.trainable_variables]
    assert int(model.b_optimizer.iterations.numpy()) == 4
    assert np.abs(model.b.kernel.numpy() - before).max() > 1e-4


def _second_optimizer_run(run_eagerly=False, epochs=2, callbacks=(), devices=TWO):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 2)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    keras.utils.set_random_seed(0)
    with kt.distributed("mirrored", devices=devices):
        model = SecondOptimizerModel(keras.optimizers.Adam(0.1))
        model.compile(optimizer="sgd", run_eagerly=run_eagerly)
        model(x[:1])
        model.fit(x, y, batch_size=4, epochs=epochs, verbose=0, callbacks=list(callbacks))
    return model


def test_an_optimizer_first_used_in_a_step_run_eagerly_builds_across_towers():
    """Run eagerly, the towers meet where the optimizer is first used and
    it is built there, once: the run equals the compiled one."""
    eager, compiled = _second_optimizer_run(run_eagerly=True), _second_optimizer_run()
    assert eager.b_optimizer.built and int(eager.b_optimizer.iterations.numpy()) == 8
    for a, b in zip(eager.weights + eager.b_optimizer.variables,
                    compiled.weights + compiled.b_optimizer.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6, err_msg=a.path)


def test_an_optimizer_without_slots_built_on_first_use_is_resumed(tmp_path):
    """An SGD without momentum has no slots, only its step counter: the
    checkpoint's manifest says what each optimizer was built on, so a
    resume builds it and restores its counter (and a learning-rate
    schedule reading it)."""

    class Sgd(SecondOptimizerModel):
        def __init__(self, second_optimizer):
            super().__init__(keras.optimizers.SGD(0.05))

    folder = str(tmp_path / "ckpt")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 2)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")

    def run(epochs, callbacks=()):
        keras.utils.set_random_seed(0)
        with kt.distributed("mirrored", devices=TWO):
            model = Sgd(None)
            model.compile(optimizer="sgd")
            model(x[:1])
            model.fit(x, y, batch_size=4, epochs=epochs, verbose=0, callbacks=list(callbacks))
        return model

    run(1, [kt.callbacks.ModelSaver(folder)])
    manifest = kt.checkpoint.verify_checkpoint(kt.checkpoint.latest_checkpoint(folder))
    built_on = manifest["optimizers"]["b_optimizer"]
    assert [key.split("/")[-2:] for key in built_on] == [["b", "kernel"], ["b", "bias"]], built_on
    resumed = run(3, [kt.callbacks.AutoResume(folder)])
    straight = run(3)
    assert int(resumed.b_optimizer.iterations.numpy()) == int(straight.b_optimizer.iterations.numpy()) == 12
    for a, b in zip(resumed.weights, straight.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6, err_msg=a.path)


def test_a_variable_some_towers_do_not_use_is_trained_and_an_unused_one_is_left_alone():
    class TowerDependent(kt.TowerModel):
        def __init__(self):
            super().__init__()
            self.shared = keras.layers.Dense(1)
            self.tower1_only = keras.layers.Dense(1)
            self.unused = keras.layers.Dense(1)

        def call(self, x):
            ctx = kt.get_current_tower_context()
            out = self.shared(x)
            if ctx is None or ctx.index == 1:
                out = out + self.tower1_only(x)
            if ctx is None:
                out = out + 0.0 * self.unused(x)
            return out

    with kt.distributed("mirrored", devices=TWO):
        model = TowerDependent()
        # Weight decay would move a variable given a zero gradient.
        model.compile(optimizer=keras.optimizers.AdamW(0.05, weight_decay=0.5), loss="mse")
        x, y = np.ones((16, 2), "float32"), np.full((16, 1), 3.0, "float32")
        model.fit(x, y, batch_size=4, epochs=0, verbose=0)
        unused = model.unused.kernel.numpy().copy()
        tower1 = model.tower1_only.kernel.numpy().copy()
        model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert np.abs(model.tower1_only.kernel.numpy() - tower1).max() > 1e-3
    np.testing.assert_array_equal(model.unused.kernel.numpy(), unused)


def test_run_eagerly_evaluate_with_an_idle_tower_is_exact():
    from tests.tensorflow.helpers import id_data, mlp

    x, y = id_data(40)  # batch 16 on 2 towers: the second step has one idle tower
    with kt.distributed("mirrored", devices=TWO):
        two = mlp(run_eagerly=True)
        logs = two.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    one = mlp()
    one.set_weights(two.get_weights())
    expected = one.evaluate(x, y, batch_size=40, verbose=0, return_dict=True)
    for key in ("loss", "accuracy"):
        assert logs[key] == pytest.approx(expected[key], abs=1e-6)


def test_a_plain_keras_model_fitted_inside_kt_distributed_warns_once():
    x, y = np.ones((16, 2), "float32"), np.ones((16, 1), "float32")
    with kt.distributed("mirrored", devices=TWO):
        inputs = keras.Input((2,))
        plain = keras.Model(inputs, keras.layers.Dense(1)(inputs))
        plain.compile(optimizer="sgd", loss="mse")
        with pytest.warns(UserWarning, match=r"plain keras.Model.*kt.TowerModel\(model\)"):
            plain.fit(x, y, batch_size=8, verbose=0)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            plain.fit(x, y, batch_size=8, verbose=0)  # once per model


def test_stock_keras_fit_is_patched_only_inside_kt_distributed():
    """The check above wraps Keras's TensorFlow fit while a kt.distributed
    block is open (nested blocks too); outside, Keras runs as installed."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    original = TensorFlowTrainer.fit
    with kt.distributed("mirrored", devices=TWO):
        assert TensorFlowTrainer.fit is not original
        assert TensorFlowTrainer.fit.__wrapped__ is original
        with kt.distributed("single"):
            assert TensorFlowTrainer.fit.__wrapped__ is original
        assert TensorFlowTrainer.fit.__wrapped__ is original
    assert TensorFlowTrainer.fit is original


def test_the_keras_io_step_returning_every_metric_by_name_does_not_warn():
    class KerasIoFirstStep(kt.TowerModel):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                                 self.trainable_variables)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    import warnings

    with kt.distributed("mirrored", devices=TWO):
        inputs = keras.Input((2,))
        model = KerasIoFirstStep(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            history = model.fit(np.ones((16, 2), "float32"), np.ones((16, 1), "float32"),
                                batch_size=4, verbose=0)
    assert sorted(history.history) == ["loss", "mae"]


def test_a_wrapped_monitor_counts_as_present_and_a_wrapped_auto_resume_restores(tmp_path):
    from kerastower.callbacks.base import unwrapped
    from kerastower.loop.main_loop import training_callbacks

    towers = kt.distributed("mirrored", devices=TWO)
    with towers:
        inputs = keras.Input((2,))
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
    wrapped = kt.callbacks.PeriodicTrigger(kt.callbacks.JSONWriter(str(tmp_path)), every_k_epochs=2)
    made = training_callbacks(model, model.loop, [wrapped], 0, str(tmp_path), 1, 1).callbacks
    writers = [cb for cb in made if isinstance(unwrapped(cb), kt.callbacks.JSONWriter)]
    assert writers == [wrapped]

    ckpt = str(tmp_path / "ckpt")
    data = tf.data.Dataset.from_tensors((tf.ones([4, 2]), tf.ones([4, 1]))).repeat()
    with towers:
        model.fit(data, steps_per_epoch=2, epochs=1, verbose=0,
                  callbacks=[kt.callbacks.ModelSaver(ckpt)])
        inputs = keras.Input((2,))
        resumed = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        resumed.compile(optimizer="sgd", loss="mse")
        always = kt.callbacks.EnableCallbackIf(kt.callbacks.AutoResume(ckpt), lambda cb: True)
        resumed.fit(data, steps_per_epoch=2, epochs=2, verbose=0, callbacks=[always])
    assert resumed.loop.global_step == 4
