"""Tower contexts, tower rules, and the state that must stay one per model."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

import kerastower as kt
from kerastower import backend as kt_backend
from tests.tensorflow.helpers import TWO, id_data, mlp


class ContextProbe(keras.layers.Layer):
    """Records the tower context every time the layer is traced."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.contexts = []

    def call(self, x):
        ctx = kt.get_current_tower_context()
        self.contexts.append(
            None
            if ctx is None
            else (ctx.name, ctx.index, type(ctx.index), ctx.total, ctx.is_training,
                  ctx.is_main_training_tower)
        )
        return x


def test_tower_context_in_fit_evaluate_and_predict(two_towers):
    x, y = id_data(16)
    probe = ContextProbe()
    model = mlp(probe)
    assert kt.get_current_tower_context() is None
    model.fit(x, y, batch_size=4, verbose=0)
    model.evaluate(x, y, batch_size=4, verbose=0)
    model.predict(x, batch_size=4, verbose=0)
    traced = set(c for c in probe.contexts if c is not None)
    assert traced == {
        ("tower0", 0, int, 2, True, True),
        ("tower1", 1, int, 2, True, False),
        ("eval_tower0", 0, int, 2, False, False),
        ("eval_tower1", 1, int, 2, False, False),
        ("predict_tower0", 0, int, 2, False, False),
        ("predict_tower1", 1, int, 2, False, False),
    }
    assert kt.get_current_tower_context() is None


def test_tower_context_rejects_bad_values():
    with pytest.raises(ValueError, match="index=2, total=2"):
        kt.TowerContext(index=2, total=2, is_training=True)
    with pytest.raises(TypeError, match="Python ints"):
        kt.TowerContext(index=tf.constant(0), total=2, is_training=True)


class LayerInCall(kt.TowerModel):
    def call(self, x):
        return keras.layers.Dense(2, name="made_in_call")(x)


class VariableInStep(kt.TowerModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        self.counter = tf.Variable(0.0, name="step_counter")
        return super().train_step(data)


class PerExampleLoss(kt.TowerModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return tf.reduce_sum(tf.square(y_pred), axis=-1)


@pytest.mark.parametrize(
    "model_cls, match",
    [
        (LayerInCall, r"created the variable '.*' \(by the layer '.*made_in_call.*'.*Build that layer before fit"),
        (VariableInStep, r"created the variable 'step_counter'.*tf.Variables"),
        (PerExampleLoss, r"loss must be a scalar; got a tensor of shape \(None,\)|\(4,\)"),
    ],
)
def test_tower_rule_violations_raise(two_towers, model_cls, match):
    x, y = id_data(16)
    model = model_cls()
    model.compile(optimizer="sgd", loss="mse")
    model(x[:2])  # build, as a user would
    with pytest.raises(kt.TowerRuleError, match=match):
        model.fit(x, np.zeros((16, 2), "float32"), batch_size=4, verbose=0)


def test_subclassed_model_trains_on_towers(two_towers):
    class Net(kt.TowerModel):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(8, activation="relu")
            self.out = keras.layers.Dense(1)

        def call(self, x):
            return self.out(self.hidden(x))

    x, _ = id_data(32)
    y = x.sum(axis=1, keepdims=True)
    model = Net()
    model.compile(optimizer="adam", loss="mse")
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert model.num_towers == 2 and len(history.history["loss"]) == 2


def test_functional_use_leaves_the_classes_untouched(two_towers):
    """Keras turns a class used as `Cls(inputs, outputs)` functional by
    rewriting its bases; TowerModel and its subclasses must stay as written."""

    class Custom(kt.TowerModel):
        """A subclass used functionally."""

    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2)(inputs)
    functional = kt.TowerModel(inputs, outputs)
    custom = Custom(inputs, outputs)
    assert isinstance(functional, kt.TowerModel) and isinstance(custom, Custom)
    assert kt.TowerModel.__bases__ == (kt_backend.tower_steps(), keras.Model)   # not made functional
    assert Custom.__bases__ == (kt.TowerModel,)

    class Later(kt.TowerModel):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    assert Later().dense.units == 2


def test_wrap_existing_keras_models(two_towers):
    x, y = id_data(32)
    inputs = keras.Input((4,))
    functional = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    sequential = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    for keras_model in (functional, sequential, Sub()):
        tower_model = kt.TowerModel.wrap(keras_model)
        assert isinstance(tower_model, kt.TowerModel)
        tower_model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        tower_model.fit(x, y, batch_size=4, verbose=0)
        # The wrapped model's own weights were trained.
        np.testing.assert_array_equal(
            keras_model.get_weights()[0], tower_model.get_weights()[0]
        )


def _existing_keras_model(kind):
    keras.utils.set_random_seed(1)
    if kind == "sequential":
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                 keras.layers.Dense(3)])
    if kind == "functional":
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        return keras.Model(inputs, keras.layers.Dense(3)(hidden))

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(8, activation="relu")
            self.out = keras.layers.Dense(3)

        def call(self, x):
            return self.out(self.hidden(x))

    return Subclassed()


@pytest.mark.parametrize("kind", ["sequential", "functional", "subclassed"])
def test_tower_model_of_an_existing_model_equals_one_device_on_the_joined_batch(kind):
    x, y = id_data(32)
    weights = []
    for strategy, devices, batch in (("single", None, 8), ("mirrored", TWO, 4)):
        with kt.distributed(strategy, devices=devices):
            keras_model = _existing_keras_model(kind)
            model = kt.TowerModel(keras_model)
            assert isinstance(model, kt.TowerModel) and kt.TowerModel(model) is model
            model.compile(optimizer=keras.optimizers.Adam(0.01),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
            # The Keras model's own weights are the ones trained.
            for own, trained in zip(keras_model.get_weights(), model.get_weights()):
                np.testing.assert_array_equal(own, trained)
            weights.append(model.get_weights())
    for one_device, towers in zip(*weights):
        np.testing.assert_allclose(towers, one_device, atol=1e-5)


def test_tower_model_of_a_model_with_more_arguments_says_what_to_do():
    with pytest.raises(TypeError, match=r"takes an existing Keras model alone; got also name"):
        kt.TowerModel(_existing_keras_model("sequential"), name="other")


def test_logs_are_example_weighted_over_towers_per_batch_and_at_epoch_end(two_towers):
    """Tower 0 takes 2 examples a step, tower 1 takes 6: the logged loss is
    the mean over the 8 examples, per batch and at the end of the epoch."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.integers(0, 3, 64).astype("int32")

    def pipeline(ctx):
        size = 2 if ctx.index == 0 else 6
        part = slice(0, 16) if ctx.index == 0 else slice(16, 64)
        return tf.data.Dataset.from_tensor_slices((x[part], y[part])).batch(size)

    model = mlp(optimizer=keras.optimizers.SGD(0.0))  # weights fixed: losses are knowable
    batch_logs = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: batch_logs.append(float(logs["loss"]))
    )
    history = model.fit(kt.DatasetInput(pipeline), verbose=0, callbacks=[callback])
    per_example = keras.losses.sparse_categorical_crossentropy(
        y, model.predict(x, batch_size=64, verbose=0), from_logits=True
    ).numpy()
    step_ids = [np.r_[2 * s: 2 * s + 2, 16 + 6 * s: 16 + 6 * s + 6] for s in range(8)]
    expected_running = [per_example[np.concatenate(step_ids[: s + 1])].mean() for s in range(8)]
    np.testing.assert_allclose(batch_logs, expected_running, rtol=1e-5)
    assert history.history["loss"][0] == pytest.approx(per_example.mean(), rel=1e-5)


def test_summaries_are_written_once_per_step(two_towers, tmp_path):
    class Summarized(keras.layers.Layer):
        def call(self, x):
            tf.summary.scalar("tower_input_mean", tf.reduce_mean(x), step=0)
            return x

    x, y = id_data(32)
    model = mlp(Summarized())
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default():
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # 4 steps
    writer.flush()
    accumulator = event_accumulator.EventAccumulator(str(tmp_path))
    accumulator.Reload()
    tags = [t for t in accumulator.Tags()["tensors"] if t.endswith("tower_input_mean")]
    assert len(tags) == 1, tags  # only the main tower writes, under one name
    assert len(accumulator.Tensors(tags[0])) == 4  # 32 examples / (2 towers x 4)


@pytest.mark.parametrize("synchronized", [False, True])
def test_batchnorm_statistics_follow_the_main_tower_or_all_towers(synchronized):
    """BN right after the input: its moving mean after one step is
    momentum-free arithmetic on the batches, so we can say whose it is."""
    with kt.distributed("mirrored", devices=TWO):
        inputs = keras.Input((3,))
        bn = keras.layers.BatchNormalization(momentum=0.5, synchronized=synchronized)
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(bn(inputs)))
        model.compile(optimizer="sgd", loss="mse")
        x = np.concatenate([np.full((4, 3), 2.0), np.full((4, 3), 10.0)]).astype("float32")
        model.fit(x, np.zeros((8, 1), "float32"), batch_size=4, shuffle=False, verbose=0)
        copies = [v.numpy() for v in bn.moving_mean.value.values]
    expected = 0.5 * 6.0 if synchronized else 0.5 * 2.0  # all towers' mean, or tower 0's
    for copy in copies:
        np.testing.assert_allclose(copy, expected, rtol=1e-6)
    np.testing.assert_allclose(model.get_weights()[2], expected, rtol=1e-6)


def test_towers_draw_their_own_random_numbers(two_towers):
    """Dropout must not draw the same mask on every tower."""
    masks = {}

    class MaskProbe(keras.layers.Layer):
        def call(self, x):
            ctx = kt.get_current_tower_context()
            if ctx is not None and ctx.is_training:
                def keep(m, index=ctx.index):
                    masks.setdefault(index, []).append(np.asarray(m) != 0)
                    return np.int32(0)

                token = tf.numpy_function(keep, [x], tf.int32, stateful=True)
                with tf.control_dependencies([token]):
                    x = tf.identity(x)
            return x

    inputs = keras.Input((64,))
    out = keras.layers.Dense(1)(MaskProbe()(keras.layers.Dropout(0.5)(inputs)))
    model = kt.TowerModel(inputs, out)
    model.compile(optimizer="sgd", loss="mse")
    ones = np.ones((16, 64), "float32")
    model.fit(ones, np.zeros((16, 1), "float32"), batch_size=4, verbose=0)
    assert len(masks[0]) == len(masks[1]) == 2
    for m0, m1 in zip(masks[0], masks[1]):
        assert (m0 != m1).mean() > 0.2


def test_frozen_layers_are_not_copied_between_towers(two_towers):
    inputs = keras.Input((4,))
    frozen = keras.layers.Dense(8, trainable=False)
    bn = keras.layers.BatchNormalization()
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(bn(frozen(inputs))))
    from kerastower.backend.tensorflow import tower_scope

    local = {id(w) for w in tower_scope._replica_local_weights(model)}
    assert local == {id(bn.moving_mean), id(bn.moving_variance)}


def test_jit_compile_is_applied_without_warnings(two_towers):
    """jit_compile=True compiles the towers' work (tests/tensorflow/test_performance.py
    checks the result); "auto" is Keras's one-device rule: no XLA on a CPU."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        models = [mlp(), mlp(jit_compile="auto"), mlp(jit_compile=True)]
    assert not [w for w in caught if "jit_compile" in str(w.message)]
    assert [m.tower_jit_compile for m in models] == [False, False, True]


def test_training_does_not_reorder_the_model_variables(two_towers):
    """Keras tracks lists of variables set as model attributes as the model's
    own variables; kerastower's caches must not, or get_weights() order and
    checkpoints would change after fit."""
    inputs = keras.Input((4,))
    h = keras.layers.BatchNormalization()(keras.layers.Dropout(0.2)(keras.layers.Dense(8)(inputs)))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer="sgd", loss="mse")
    before = [id(v) for v in model.variables]
    shapes = [w.shape for w in model.get_weights()]
    model.fit(np.ones((16, 4)), np.ones((16, 1)), batch_size=4, verbose=0)
    assert [id(v) for v in model.variables] == before
    assert [w.shape for w in model.get_weights()] == shapes
