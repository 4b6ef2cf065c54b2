"""`compile(steps_per_execution=K)` on JAX: K steps in one jitted call (a
`lax.scan`), the same training as one step a call, callbacks once a call."""

import itertools

import keras
import numpy as np
import pytest

import kerastower as kt


def _model(steps_per_execution, towers=2, check_finite=True):
    keras.utils.set_random_seed(3)
    with kt.distributed("mirrored", devices=list(range(towers))):
        inputs = keras.Input((5,))
        h = keras.layers.Dense(8, activation="relu")(inputs)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.Dropout(0.3)(h)
        model = kt.TowerModel(inputs, keras.layers.Dense(3)(h))
        model.compile(optimizer=keras.optimizers.Adam(1e-2), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=steps_per_execution, check_finite=check_finite)
    return model


def _ran_as_one_call(model, steps):
    """Whether `steps` steps ran as one jitted call (its compiled function
    is keyed by mode and by whether it takes its state as its own)."""
    return any(mode == f"train_steps:{steps}" for mode, _ in model.engine.tower_steps()._functions)


def _data(n=100):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 5)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1).astype("int32")


class Calls(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append((batch, round(float(logs["loss"]), 6)))


def _fit(steps_per_execution, towers=2, **fit_args):
    model = _model(steps_per_execution, towers)
    calls = Calls()
    keras.utils.set_random_seed(4)   # the arrays' shuffling seed
    history = model.fit(*_data(), batch_size=8, verbose=0, callbacks=[calls], **fit_args)
    return model, history.history, calls.ends


@pytest.mark.parametrize("towers", [1, 2])
def test_several_steps_a_call_train_as_one_step_a_call(towers):
    # 100 examples, 8 a tower: 6 whole steps and a short last one (joined) a pass.
    one, one_logs, one_calls = _fit(1, towers, epochs=2)
    many, many_logs, many_calls = _fit(4, towers, epochs=2)
    assert many.loop.global_step == one.loop.global_step
    assert _ran_as_one_call(many, 4)
    for a, b in zip(one.variables, many.variables):   # weights, BN statistics, seeds, slots
        np.testing.assert_allclose(np.asarray(b.value), np.asarray(a.value), atol=1e-5, err_msg=a.path)
    for key in one_logs:
        np.testing.assert_allclose(many_logs[key], one_logs[key], atol=1e-5)
    # Callbacks see a call's end: its last step, with that step's logs.
    steps = len(one_calls) // 2
    calls = [b for b, _ in many_calls[:len(many_calls) // 2]]
    expected = [min(s + 3, steps - 1) for s in range(0, steps, 4)]
    assert calls == expected, (calls, expected)
    by_step = dict(one_calls[:steps])
    for batch, loss in many_calls[:len(calls)]:
        assert loss == pytest.approx(by_step[batch], abs=1e-5)


def test_steps_per_epoch_and_a_generator_with_several_steps_a_call():
    x, y = _data(64)

    def batches():
        for i in itertools.count():
            j = i % 8
            yield x[8 * j:8 * j + 8], y[8 * j:8 * j + 8]

    results = []
    for k in (1, 3):
        model = _model(k)
        history = model.fit(batches(), steps_per_epoch=5, epochs=2, verbose=0)
        results.append((model, history.history))
    (one, one_logs), (many, many_logs) = results
    assert many.loop.global_step == 10 and many.loop.tower_batches == [10, 10]
    for a, b in zip(one.trainable_variables, many.trainable_variables):
        np.testing.assert_allclose(np.asarray(b.value), np.asarray(a.value), atol=1e-5)
    np.testing.assert_allclose(many_logs["loss"], one_logs["loss"], atol=1e-5)


def test_a_nonfinite_step_inside_a_call_stops_there():
    x, y = _data(64)
    x_bad = x.copy()
    x_bad[45] = np.nan    # step 3 (examples 32-47), tower 1 (40-47)
    model = _model(4)
    with pytest.raises(kt.NonFiniteError) as caught:
        model.fit(x_bad, y, batch_size=8, shuffle=False, verbose=0)
    assert caught.value.global_step == 3 and caught.value.towers == [1]
    assert model.loop.global_step == 2 and _ran_as_one_call(model, 4)
    reference = _model(1)
    reference.fit(x[:32], y[:32], batch_size=8, shuffle=False, verbose=0)
    for a, b in zip(reference.variables, model.variables):
        np.testing.assert_allclose(np.asarray(b.value), np.asarray(a.value), atol=1e-5, err_msg=a.path)
