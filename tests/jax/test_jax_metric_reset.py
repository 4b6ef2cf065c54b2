"""On JAX, `TowerModel.reset_metrics` writes zeros kept on the device where
Keras's own reset writes zeros, and runs any other reset as it is: every
metric variable ends as `keras.Model.reset_metrics` leaves it."""

import keras
import numpy as np

import kerastower as kt


class ResetsToSeven(keras.metrics.Metric):
    """A user's metric whose reset writes 7, not 0."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.level = self.add_variable((), initializer="zeros", name="level")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.level.assign_add(keras.ops.mean(y_pred))

    def reset_state(self):
        self.level.assign(7.0)

    def result(self):
        return keras.ops.convert_to_tensor(self.level)


class MeanWithACount(keras.metrics.Mean):
    """Keras's Mean reset (total and count only) on a metric with one more
    variable: that one keeps its value across a reset."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.updates = self.add_variable((), initializer="zeros", name="updates")

    def update_state(self, y_true, y_pred, sample_weight=None):
        super().update_state(y_pred, sample_weight)
        self.updates.assign_add(1.0)


def _model():
    with kt.distributed("mirrored", devices=[0, 1]):
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        model = kt.TowerModel(inputs, {"a": keras.layers.Dense(3, name="a")(hidden),
                                       "b": keras.layers.Dense(1, name="b")(hidden)})
        model.compile(
            optimizer="sgd",
            loss={"a": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "b": "mse"},
            metrics={"a": ["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2)],
                     "b": ["mae", keras.metrics.RootMeanSquaredError(), ResetsToSeven(name="seven"),
                           MeanWithACount(name="extra")]},
            weighted_metrics={"b": [keras.metrics.MeanSquaredError(name="wmse")]},
        )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = {"a": rng.integers(0, 3, size=(32,)), "b": rng.normal(size=(32, 1)).astype("float32")}
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model


def _values(model):
    return [np.asarray(v.value) for v in model.metrics_variables]


def _reset_as_keras_does(model):
    for metric in model.metrics:
        metric.reset_state()


def test_reset_metrics_leaves_every_metric_variable_as_keras_reset_does():
    model = _model()
    trained = _values(model)
    assert len(trained) >= 16 and any(np.any(v != 0) for v in trained)

    model.reset_metrics()
    ours = _values(model)

    for variable, value in zip(model.metrics_variables, trained):
        variable.assign(value)
    _reset_as_keras_does(model)
    keras_own = _values(model)

    assert [v.dtype for v in ours] == [v.dtype for v in keras_own]
    for got, want in zip(ours, keras_own):
        np.testing.assert_array_equal(got, want)
    # The user's reset ran (7), and Mean's left the extra variable alone.
    names = [v.path for v in model.metrics_variables]
    assert any(np.all(v == 7.0) for v in ours)
    kept = [i for i, name in enumerate(names) if name.endswith("updates")]
    assert len(kept) == 1 and ours[kept[0]] == trained[kept[0]] > 0


def test_after_a_reset_fit_logs_what_keras_reset_then_fit_logs():
    model = _model()
    weights = model.get_weights()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = {"a": rng.integers(0, 3, size=(16,)), "b": rng.normal(size=(16, 1)).astype("float32")}
    ours = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history

    model.set_weights(weights)
    model.optimizer.iterations.assign(0)
    original = kt.TowerModel.reset_metrics
    try:
        kt.TowerModel.reset_metrics = lambda self: (_reset_as_keras_does(self),
                                                    [s.reset_metrics() for s in self.engine.all_tower_steps()])
        keras_reset = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    finally:
        kt.TowerModel.reset_metrics = original
    assert ours.keys() == keras_reset.keys()
    for name in ours:
        np.testing.assert_allclose(ours[name], keras_reset[name], rtol=1e-6, err_msg=name)


def test_a_zero_reset_puts_no_new_array_on_the_device():
    model = _model()
    model.reset_metrics()
    loss_total = model.metrics[0].variables[0]
    first = loss_total.value
    model.fit(np.ones((8, 4), "float32"), {"a": np.zeros((8,)), "b": np.ones((8, 1), "float32")},
              batch_size=4, verbose=0)
    model.reset_metrics()
    assert loss_total.value is first


def test_a_deleted_zero_array_is_made_again():
    model = _model()
    model.reset_metrics()
    loss_total = model.metrics[0].variables[0]
    loss_total.value.delete()  # what a jitted call that took it as donated does
    model.reset_metrics()
    assert float(loss_total.numpy()) == 0.0


def test_metrics_parts_of_compile_are_found_on_this_keras():
    from kerastower._compat import on_jax

    model = _model()
    compiled = [m for m in model.metrics if on_jax.compile_metrics_parts(m) is not None]
    assert len(compiled) == 1
    names = set()

    def walk(metric):
        parts = on_jax.compile_metrics_parts(metric)
        if parts is None:
            names.add(metric.name)
        else:
            for part in parts:
                walk(part)

    walk(compiled[0])
    assert {"accuracy", "seven", "wmse", "extra"} <= {n.split("_", 1)[-1] for n in names} | names


def test_an_int64_metric_keeps_its_zeros_as_jax_holds_them():
    """Without x64, JAX holds an int64 variable as int32: the zeros kept are
    int32 too, so a second reset puts nothing new on the device."""
    count = keras.metrics.Sum(dtype="int64", name="count")
    inputs = keras.Input((4,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    model.counted = count  # a metric the model tracks, besides compile's
    model.compile(optimizer="sgd", loss="mse")
    assert any(m is count for m in model.metrics)
    model.fit(np.ones((8, 4), "float32"), np.ones((8, 1), "float32"), batch_size=4, verbose=0)
    model.reset_metrics()
    first = count.variables[0].value
    count.update_state(np.array([3]))
    model.reset_metrics()
    assert count.variables[0].value is first and int(count.result()) == 0


def test_a_reset_set_on_the_metric_itself_runs():
    """Keras's reset_metrics calls `metric.reset_state()`, which may be one
    set on the instance: it runs, not the zeros of its class's."""
    mae = keras.metrics.MeanAbsoluteError(name="mae")
    inputs = keras.Input((4,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse", metrics=[mae])
    model.fit(np.ones((8, 4), "float32"), np.ones((8, 1), "float32"), batch_size=4, verbose=0)
    mae.reset_state = lambda: mae.total.assign(5.0)
    model.reset_metrics()
    assert float(mae.total.numpy()) == 5.0 and float(mae.count.numpy()) > 0
