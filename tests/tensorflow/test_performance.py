"""XLA in towers and the collectives a step launches (speed itself is
measured in benchmarks/, not here)."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerastower as kt
from tests.tensorflow.helpers import TWO
from kerastower import _compat

B = 8


def _data(n=72, seed=5):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n).astype("int32")


class WeightedLoss(kt.TowerModel):
    """A compute_loss override: it must be compiled and reduced like the rest."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return loss + 1e-3 * keras.ops.mean(keras.ops.square(y_pred))


def _model(cls=kt.TowerModel, norm=True, **compile_args):
    inputs = keras.Input((6,))
    h = keras.layers.Dense(16, activation="gelu")(inputs)
    if norm:
        h = keras.layers.LayerNormalization()(h)
    model = cls(inputs, keras.layers.Dense(3)(h))
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **compile_args,
    )
    return model


def _run(strategy, devices, jit, batch, cls=kt.TowerModel):
    x, y = _data()
    with kt.distributed(strategy, devices=devices):
        keras.utils.set_random_seed(7)
        model = _model(cls, jit_compile=jit)
        history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
        logs = model.evaluate(x, y, batch_size=batch, verbose=0, return_dict=True)
        predictions = model.predict(x, batch_size=batch, verbose=0)
    return model, history.history, logs, predictions


@pytest.mark.parametrize("cls", [kt.TowerModel, WeightedLoss], ids=["compiled_loss", "compute_loss"])
def test_xla_towers_equal_one_device_without_xla(cls):
    """2 towers with XLA, 1 device with XLA and 2 towers without all equal one
    device without XLA on the joined batch (72 examples: a short last step).
    So does "mirrored" on one device with XLA, whose optimizer update is a
    cross-replica call that XLA cannot hold (it raised "merge_call called
    while defining a new graph")."""
    reference, ref_history, ref_logs, ref_predictions = _run("single", None, False, 2 * B, cls)
    for strategy, devices, jit, batch in [("single", None, True, 2 * B),
                                          ("mirrored", TWO[:1], True, 2 * B),
                                          ("mirrored", TWO, True, B),
                                          ("mirrored", TWO, False, B)]:
        model, history, logs, predictions = _run(strategy, devices, jit, batch, cls)
        for mine, theirs in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(mine, theirs, atol=1e-5)
        np.testing.assert_allclose(history["loss"], ref_history["loss"], atol=1e-5)
        for key in ref_logs:
            assert logs[key] == pytest.approx(ref_logs[key], abs=1e-5), key
        np.testing.assert_allclose(predictions, ref_predictions, atol=1e-5)
        calls = sum(_compat.xla_compiled_calls(f) for f in
                    (model.train_function, model.test_function, model.predict_function))
        assert (calls > 0) == jit, (strategy, jit, calls)


def test_jit_compile_values():
    """"auto" follows Keras's one-device rule (XLA with an accelerator: none
    here); anything but True/False/"auto" is refused."""
    model = _model(jit_compile="auto")
    assert model.tower_jit_compile is False
    with pytest.raises(kt.ArgumentError, match="jit_compile must be True, False"):
        _model(jit_compile="yes")


def test_overridden_train_step_on_towers_warns_that_xla_does_not_reach_it():
    class Custom(kt.TowerModel):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x, y, self(x, training=True))
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                                 self.trainable_variables)
            return {}

    x, y = _data()
    with kt.distributed("mirrored", devices=TWO):
        model = _model(Custom, jit_compile=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=B, verbose=0)
    assert any("does not compile Custom.train_step on 2 towers" in str(w.message) for w in caught)


def _gradient_tensors(model):
    return len(model.trainable_variables)


def test_static_equal_batches_launch_one_all_reduce_per_step():
    """Repeated arrays (a static per-tower batch): one all-reduce, of the
    gradients, per step; no example count, no metrics (read at log time,
    locally); nothing on one device."""
    x, y = _data(64)
    with kt.distributed("mirrored", devices=TWO):
        model = _model(norm=False)
        model.fit(x, y, batch_size=B, steps_per_epoch=3, verbose=0)
    assert kt.collectives_per_step(model) == {
        "step": [("all_reduce", _gradient_tensors(model))], "logs": []}
    single = _model(norm=False)
    single.fit(x, y, batch_size=B, steps_per_epoch=3, verbose=0)
    assert kt.collectives_per_step(single) == {"step": [], "logs": []}


def test_dynamic_batches_fold_the_example_count_into_the_gradient_all_reduce():
    """A pass with a short last batch: the towers' example counts ride in
    the gradients' all-reduce (one more tensor), not in one of their own."""
    x, y = _data(60)
    with kt.distributed("mirrored", devices=TWO):
        model = _model(norm=False)
        model.fit(x, y, batch_size=B, verbose=0)
    assert kt.collectives_per_step(model)["step"] == [
        ("all_reduce", _gradient_tensors(model) + 1)]


def test_batch_normalization_adds_one_all_reduce_of_its_statistics():
    inputs = keras.Input((6,))
    x, y = _data(64)
    with kt.distributed("mirrored", devices=TWO):
        h = keras.layers.BatchNormalization()(keras.layers.Dense(8)(inputs))
        model = kt.TowerModel(inputs, keras.layers.Dense(3)(h))
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=B, steps_per_epoch=2, verbose=0)
    assert kt.collectives_per_step(model)["step"] == [
        ("all_reduce", len(model.trainable_variables)), ("all_reduce", 2)]


def test_reading_example_weight_in_a_tower_still_works():
    """`TowerContext.example_weight` is computed when read (with its own
    all-reduce): each tower's share of the step's examples."""
    seen = []

    class Reads(kt.TowerModel):
        def train_step(self, data):
            ctx = kt.get_current_tower_context()

            def record(index, weight):
                seen.append((int(index), round(float(weight), 6)))
                return np.int32(0)

            token = tf.numpy_function(record, [ctx.index, ctx.example_weight], tf.int32,
                                      stateful=True)
            with tf.control_dependencies([token]):
                return super().train_step(data)

    x, y = _data(12)
    with kt.distributed("mirrored", devices=TWO):
        model = _model(Reads, norm=False)
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert sorted(seen) == [(0, round(8 / 12, 6)), (1, round(4 / 12, 6))]
    assert ("all_reduce", 1) in kt.collectives_per_step(model)["step"]


def test_the_logs_read_across_towers_follow_a_recompile():
    """Where towers span processes, the loops read the metrics through one
    compiled function; compile() replaces the metrics, so it must too."""
    from kerastower.backend.tensorflow import step_calls

    x, y = _data(16)
    model = _model(norm=False)
    model.fit(x, y, batch_size=8, verbose=0)
    assert set(step_calls.logs_across_towers(model)) == {"loss", "accuracy"}
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent")])
    model.fit(x, y, batch_size=8, verbose=0)
    assert set(step_calls.logs_across_towers(model)) == set(model.get_metrics_result()) == {"loss", "xent"}


def _loop_ops(function, iterator, num_steps):
    graph = function.get_concrete_function(iterator, num_steps, True).graph
    return [op.type for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]


class _StepCalls(keras.callbacks.Callback):
    """Notes, at every batch's end, the `num_steps` of the step calls bound
    to the iterators of this fit (a Python int: the straight step); those
    of iterators from before it, still alive, are left out."""

    def __init__(self):
        super().__init__()
        self.num_steps = set()
        self._before = []

    def on_train_begin(self, logs=None):
        from kerastower.backend.tensorflow import step_calls

        self._before = list(step_calls._bound_calls.keys())

    on_test_begin = on_train_begin

    def on_train_batch_end(self, batch, logs=None):
        from kerastower.backend.tensorflow import step_calls

        for iterator, calls in list(step_calls._bound_calls.items()):
            if not any(iterator is old for old in self._before):
                self.num_steps.update(type(key[1]).__name__ for key in calls)

    on_test_batch_end = on_train_batch_end


def test_one_step_of_an_endless_input_runs_without_the_step_loop():
    """One step a call from an endless input (arrays on one tower) is traced
    straight and `fit` calls it so; K steps a call keep the loop, also for
    an epoch's last call of one step; all train, count and log as one
    device does from a pipeline of the same batches, of unknown length
    (which keeps the loop)."""
    from kerastower.backend.tensorflow.inputs import as_input_source

    x, y = _data(n=48)
    keras.utils.set_random_seed(3)
    model = _model()
    calls = _StepCalls()
    history = model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=[calls])
    assert "int" in calls.num_steps
    stream = as_input_source(x, y, batch_size=B).passes_in_a_row()
    iterator = iter(model.engine.place(stream))
    function = model.make_train_function()
    assert _loop_ops(function, iterator, 1) == []
    assert len(_loop_ops(function, iterator, tf.constant(3))) == 1

    keras.utils.set_random_seed(3)
    reference = _model()
    pipeline = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True).batch(B)
    expected = reference.fit(pipeline, epochs=2, verbose=0)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    for key in expected.history:
        np.testing.assert_allclose(history.history[key], expected.history[key], rtol=1e-6)
    assert model.loop.examples_seen == reference.loop.examples_seen == 96
    assert model.loop.tower_batches == reference.loop.tower_batches

    # 6 batches a pass in calls of 5: the last call of each epoch is one
    # step, and still runs the loop's trace (no second trace).
    keras.utils.set_random_seed(3)
    several = _model(steps_per_execution=5)
    calls = _StepCalls()
    several.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=[calls])
    assert calls.num_steps and "int" not in calls.num_steps
    for a, b in zip(reference.get_weights(), several.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def _two_tower_pipeline_run(n, epochs=2):
    """(the straight-call record, the model, history) of 2 towers fitting
    a shared pipeline of `n` examples in batches of B, taken in turns."""
    x, y = _data(n=n)
    with kt.distributed("mirrored", devices=TWO):
        keras.utils.set_random_seed(3)
        model = _model(norm=False)
        calls = _StepCalls()
        history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), epochs=epochs,
                            verbose=0, callbacks=[calls])
    return calls.num_steps, model, history.history


def test_a_finite_input_that_fills_every_step_runs_without_the_step_loop():
    """A finite pipeline whose passes give every tower a batch at every step
    (lengths known, equal shares) runs its one-step calls straight, as an
    endless input does, and trains, counts and logs as one device on the
    joined batches; one whose last step leaves a tower out, or whose length
    is unknown, keeps the loop."""
    x, y = _data(n=48)
    keras.utils.set_random_seed(3)
    model = _model(norm=False)
    calls = _StepCalls()
    history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), epochs=2, verbose=0,
                        callbacks=[calls])
    assert "int" in calls.num_steps
    keras.utils.set_random_seed(3)
    unknown = _model(norm=False)
    calls = _StepCalls()
    asked = unknown.fit(tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True).batch(B),
                        epochs=2, verbose=0, callbacks=[calls])
    assert calls.num_steps and "int" not in calls.num_steps
    for a, b in zip(unknown.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    for key in asked.history:
        np.testing.assert_allclose(history.history[key], asked.history[key], rtol=1e-6)
    assert model.loop.examples_seen == unknown.loop.examples_seen == 96

    # 2 towers, 6 batches a pass: 3 full steps; one device on joined batches.
    straight, towers, tower_history = _two_tower_pipeline_run(48)
    assert "int" in straight
    keras.utils.set_random_seed(3)
    reference = _model(norm=False)
    expected = reference.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(2 * B), epochs=2,
                             verbose=0)
    for a, b in zip(reference.get_weights(), towers.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for key in expected.history:
        np.testing.assert_allclose(tower_history[key], expected.history[key], rtol=1e-5)
    assert towers.loop.examples_seen == 96 and towers.loop.tower_batches == [3, 3]
    # 5 batches a pass: the last step has tower 0's batch only.
    short, towers, _ = _two_tower_pipeline_run(40)
    assert short and "int" not in short
    assert towers.loop.examples_seen == 80 and towers.loop.tower_batches == [3, 2]
    # Arrays on 2 towers, dealt out pass by pass: 6 batches fill 3 steps.
    with kt.distributed("mirrored", devices=TWO):
        keras.utils.set_random_seed(3)
        dealt = _model(norm=False)
        calls = _StepCalls()
        dealt_history = dealt.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=[calls])
    assert "int" in calls.num_steps
    for a, b in zip(reference.get_weights(), dealt.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for key in expected.history:
        np.testing.assert_allclose(dealt_history.history[key], expected.history[key], rtol=1e-5)


class _SaysNoLength(kt.DatasetInput):
    """A source whose `steps` does not say what its pipeline's cardinality does."""

    def steps(self, total):
        return None


def test_a_source_whose_length_is_not_its_pipelines_keeps_the_step_loop():
    """The loops stop at `steps`; where a source's `steps` and its
    pipeline's cardinality disagree, every step asks whether data is left,
    and fit counts every update and evaluate reads every batch."""
    from kerastower.inputs.sources import DatasetInput

    x, y = _data(n=48)
    pipeline = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
    assert DatasetInput(pipeline).fills_every_step(1)
    assert not _SaysNoLength(pipeline).fills_every_step(1)
    keras.utils.set_random_seed(3)
    model = _model(norm=False, steps_per_execution=4)
    model.fit(_SaysNoLength(pipeline), epochs=1, verbose=0)
    assert model.loop.global_step == int(model.optimizer.iterations.numpy()) == 6
    expected = model.evaluate(pipeline, verbose=0, return_dict=True)
    said = model.evaluate(_SaysNoLength(pipeline), verbose=0, return_dict=True)
    fewer = model.evaluate(_SaysNoLength(pipeline), steps=3, verbose=0, return_dict=True)
    for key in expected:
        np.testing.assert_allclose(said[key], expected[key], rtol=1e-6)
    assert fewer.keys() == expected.keys()


def test_an_evaluation_that_fills_every_step_runs_without_the_step_loop():
    """evaluate over a finite input whose every step has every tower's
    batch runs its one-step calls straight and gives the logs of the loop;
    asked for more steps than the input has, it keeps the loop and stops
    at the input's end."""
    x, y = _data(n=48)
    keras.utils.set_random_seed(3)
    model = _model(norm=False)
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)
    pipeline = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
    runs = {}
    for name, data, steps in [("filled", pipeline, None), ("unknown", pipeline.filter(lambda *_: True), None),
                              ("past the end", pipeline, 9)]:
        calls = _StepCalls()
        runs[name] = model.evaluate(data, steps=steps, verbose=0, return_dict=True, callbacks=[calls])
        assert calls.num_steps
        assert ("int" in calls.num_steps) == (name == "filled"), name
    # Fewer steps than the input has: straight, and as the loop's.
    calls = _StepCalls()
    first_three = model.evaluate(pipeline, steps=3, verbose=0, return_dict=True, callbacks=[calls])
    assert "int" in calls.num_steps
    three = model.evaluate(pipeline.filter(lambda *_: True), steps=3, verbose=0, return_dict=True)
    for key in three:
        np.testing.assert_allclose(first_three[key], three[key], rtol=1e-6)
    for name in ("unknown", "past the end"):
        assert runs[name].keys() == runs["filled"].keys()
        for key in runs["filled"]:
            np.testing.assert_allclose(runs[name][key], runs["filled"][key], rtol=1e-6)
    calls = _StepCalls()
    arrays = model.evaluate(x, y, batch_size=B, verbose=0, return_dict=True, callbacks=[calls])
    assert "int" in calls.num_steps
    for key in arrays:
        np.testing.assert_allclose(arrays[key], runs["filled"][key], rtol=1e-6)
    with kt.distributed("mirrored", devices=TWO):
        keras.utils.set_random_seed(3)
        towers = _model(norm=False)
        towers.set_weights(model.get_weights())
        calls = _StepCalls()
        on_towers = towers.evaluate(pipeline, verbose=0, return_dict=True, callbacks=[calls])
    assert "int" in calls.num_steps
    for key in on_towers:
        np.testing.assert_allclose(on_towers[key], runs["filled"][key], rtol=1e-5)
    # Several steps a call (the last call shorter) over the same input.
    model.compile(optimizer=keras.optimizers.Adam(0.01), steps_per_execution=4,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    several = model.evaluate(pipeline, verbose=0, return_dict=True)
    for key in several:
        np.testing.assert_allclose(several[key], runs["filled"][key], rtol=1e-6)


def test_a_resumed_pass_that_leaves_unequal_shares_keeps_the_step_loop():
    """A pass resumed where the towers had taken unequal numbers of a
    shared pipeline's batches, or with counts for another number of
    towers, could leave 2 towers a last step with one batch: its steps ask
    whether data is left. (A resume moved to another number of towers
    hands over equal counts, `ResumeState.on_towers`.)"""
    from kerastower.backend.tensorflow.engine import fills_every_step
    from kerastower.inputs.sources import DatasetInput

    six = DatasetInput(tf.data.Dataset.range(12).batch(2))
    with kt.distributed("mirrored", devices=TWO) as strategy:
        assert fills_every_step(six, strategy) and fills_every_step(six, strategy, [1, 1])
        assert not fills_every_step(six, strategy, [3])
        assert not fills_every_step(six, strategy, [2, 1])


def test_a_nan_in_a_straight_step_stops_at_that_step():
    from kerastower.errors import NonFiniteError

    x, y = _data(n=48)
    x[21, 2] = np.nan  # step 3 (batches of 8) takes rows 16..23
    keras.utils.set_random_seed(3)
    model = _model()
    with pytest.raises(NonFiniteError, match=r"step 3\b"):
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2
    keras.utils.set_random_seed(3)
    reference = _model()
    reference.fit(x[:16], y[:16], batch_size=B, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
