"""Towers on JAX: contexts, exact evaluation, predict order, the short last
step, and the errors TensorFlow-only features give."""

import os
import re

import jax
import keras
import numpy as np
import pytest

import kerastower as kt
from kerastower.inputs import jax_arrays as jax_inputs
from kerastower import model as jax_model
from kerastower.strategies import jax_mesh as jax_strategies
from kerastower.callbacks import defaults
from kerastower.callbacks import event_scalars
from kerastower.backend.jax import placement as jax_placement
from tests.jax.helpers import TowerRecorder

from tests.helpers.common import ROOT
from tests.helpers.doctests import examples_of
from tests.helpers.doctests import run_examples


def _model(recorder=None, devices=(0, 1)):
    with kt.distributed("mirrored", devices=list(devices)):
        inputs = keras.Input((3,))
        h = recorder(inputs) if recorder is not None else inputs
        model = kt.TowerModel(inputs, keras.layers.Dense(2)(h))
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


def test_each_tower_is_traced_once_under_its_context_with_its_own_batch():
    recorder = TowerRecorder()
    model = _model(recorder, devices=(0, 1, 2))
    model.fit(np.ones((24, 3)), np.ones((24, 2)), batch_size=4, epochs=1, verbose=0)
    training = [c for c in recorder.contexts if c[2].startswith("tower")]
    assert sorted(training) == [(0, 3, "tower0", 4), (1, 3, "tower1", 4), (2, 3, "tower2", 4)]
    assert all(type(c[0]) is int for c in training)
    assert model.loop.global_step == 2


def test_evaluate_counts_every_example_once_and_predict_keeps_input_order():
    model = _model()
    x = np.random.default_rng(0).normal(size=(40, 3)).astype("float32")
    y = np.random.default_rng(1).normal(size=(40, 2)).astype("float32")
    got = model.evaluate(x, y, batch_size=8, return_dict=True, verbose=0)
    predictions = model.predict(x, batch_size=8, verbose=0)
    expected = model(x).__array__()
    np.testing.assert_allclose(predictions, expected, atol=1e-6)
    # 40 examples: 2 steps of 2 x 8, then one step of the last 8 on one tower.
    np.testing.assert_allclose(got["loss"], np.mean((expected - y) ** 2), atol=1e-6)
    np.testing.assert_allclose(got["mae"], np.mean(np.abs(expected - y)), atol=1e-6)


def test_a_short_last_step_runs_as_one_tower_on_the_joined_batch():
    x = np.random.default_rng(2).normal(size=(20, 3)).astype("float32")
    y = np.random.default_rng(3).normal(size=(20, 2)).astype("float32")
    keras.utils.set_random_seed(5)
    one = _model(devices=(0,))
    keras.utils.set_random_seed(5)
    two = _model(devices=(0, 1))
    two.set_weights(one.get_weights())
    one.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    two.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert one.loop.global_step == two.loop.global_step == 4
    for a, b in zip(one.get_weights(), two.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-6)


def test_towers_need_batches_of_one_shape():
    from kerastower.backend.jax import step as jax_step

    mesh = jax_step.tower_mesh(jax.devices()[:2])
    with pytest.raises(kt.DataMismatchError, match="one shape"):
        jax_step.place_tower_batches(mesh, [(np.ones((4, 3)),), (np.ones((3, 3)),)])


@pytest.mark.parametrize("name", ["horovod", "multiworker"])
def test_tensorflow_only_strategies_say_what_to_use_instead(name):
    with pytest.raises(kt.StrategyError, match='On JAX use "mirrored"'):
        with kt.distributed(name):
            pass


def test_a_tf_data_pipeline_gets_a_clear_error():
    model = _model()
    with pytest.raises(kt.InputSourceError, match="numpy arrays"):
        model.fit(object(), verbose=0)


def test_the_jax_page_and_docstrings_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open(os.path.join(ROOT, "docs", "jax.md")) as f:
        text = f.read()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    with open(os.path.join(ROOT, "docs", "trainers.md")) as f:
        blocks += [b for b in re.findall(r"```python\n(.*?)```", f.read(), flags=re.S) if "kt.minimize" in b]
    for block in blocks:
        exec(compile(block, "docs/jax.md", "exec"), {"__name__": "docs_jax"})
    from kerastower.backend.jax import optimizer_apply

    tests = [test for owner in (jax_model, jax_inputs, jax_strategies, jax_placement, event_scalars,
                                defaults, kt.minimize, kt.Trainer, optimizer_apply)
             for test in examples_of(owner)]
    failures = run_examples(tests, tmp_path)
    assert not failures, failures[-3000:]


def _towers_run(branch, num_towers=2):
    """`on_every_tower(branch)` in a shard_map over `num_towers` devices: the
    jaxpr of the whole, and each tower's result."""
    from jax.sharding import PartitionSpec
    from kerastower.backend.jax import towers as jax_towers

    mesh = jax_placement.tower_mesh(jax.devices()[:num_towers])
    per_tower = PartitionSpec(jax_placement.AXIS)

    def body(x):
        return jax_towers.on_every_tower(branch, num_towers, x)

    run = jax.shard_map(body, mesh=mesh, in_specs=per_tower, out_specs=per_tower)
    x = np.arange(num_towers * 2, dtype="float32").reshape(num_towers, 2)
    return str(jax.make_jaxpr(run)(x)), np.asarray(jax.jit(run)(x))


def test_towers_whose_steps_do_not_depend_on_their_index_run_one_computation_without_a_switch():
    # XLA:CPU runs a convolution inside a conditional many times slower.
    jaxpr, result = _towers_run(lambda index, x: x * 2.0 + 1.0)
    assert "cond[" not in jaxpr and "switch" not in jaxpr
    np.testing.assert_array_equal(result, np.arange(4, dtype="float32").reshape(2, 2) * 2.0 + 1.0)


def test_towers_whose_steps_read_their_index_run_as_a_switch_each_its_own():
    jaxpr, result = _towers_run(lambda index, x: x + 10.0 * index, num_towers=3)
    assert "cond[" in jaxpr
    np.testing.assert_array_equal(result, np.arange(6, dtype="float32").reshape(3, 2) + [[0.0], [10.0], [20.0]])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_finite_check_sums_first_and_confirms_an_overflowing_sum(dtype):
    from kerastower.backend.jax.towers import all_finite

    check = jax.jit(all_finite)
    big = float(jax.numpy.finfo(dtype).max) / 2
    finite = [jax.numpy.asarray([1.0, 2.0], dtype), jax.numpy.asarray([[big, big, big]], dtype)]
    assert bool(check(finite))  # its sum overflows; every value is finite
    for bad in (np.nan, np.inf, -np.inf):
        values = [finite[0], jax.numpy.asarray([[big, bad, -big]], dtype)]
        assert not bool(check(values)), bad
    both_infinities = [jax.numpy.asarray([np.inf, -np.inf], dtype)]  # they sum to NaN
    assert not bool(check(both_infinities))
    assert bool(check([jax.numpy.arange(3)]))  # integers are not checked


@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (3, 3, 2, 4), (0, 4), (4, 0)])
def test_the_finite_check_finds_a_nan_or_an_inf_wherever_it_is_in_an_array_of_any_shape(shape):
    from kerastower.backend.jax.towers import all_finite

    check = jax.jit(all_finite)
    size = int(np.prod(shape))
    finite = np.asarray(np.arange(size, dtype="float32").reshape(shape) - size / 2)
    assert bool(check([finite, np.ones(2, "float32")]))
    for position in range(size):
        for bad in (np.nan, np.inf, -np.inf):
            values = finite.copy().reshape(-1)
            values[position] = bad
            assert not bool(check([np.ones(2, "float32"), values.reshape(shape)])), (position, bad)
    complex_values = np.array(finite + 1j * finite, "complex64")
    assert bool(check([complex_values]))
    if size:
        complex_values.flat[-1] = complex(0, np.nan)
        assert not bool(check([complex_values]))


def test_the_finite_check_on_a_cpu_sums_as_matrix_vector_products():
    """XLA:CPU reduces an array to one number on one thread: inside a step
    that cost 10-17% of a 1024-wide MLP's step, a product with ones 5-6%
    (docs/performance.md). Elsewhere the check sums as XLA reduces."""
    from kerastower.backend.jax.towers import all_finite

    values = [jax.numpy.ones((8, 4)), jax.numpy.ones((3, 3, 2, 4)), jax.numpy.ones(4)]
    # Chosen for the platform the step is compiled for.
    on_cpu = jax.jit(all_finite).trace(values).lower(lowering_platforms=("cpu",)).as_text()
    assert on_cpu.count("stablehlo.dot_general") == 3, on_cpu
    on_gpu = jax.jit(all_finite).trace(values).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.dot_general" not in on_gpu, on_gpu


class _ReadsItsInput(keras.layers.Layer):
    """Identity that reads its input's sum as a Python number, as a layer
    writing a summary or printing does: possible only op by op."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.sums = []

    def call(self, x):
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):  # not the build's
            self.sums.append(float(keras.ops.sum(x)))
        return x


@pytest.mark.parametrize("run", ["jit_compile=False", "run_eagerly=True"])
def test_one_tower_runs_op_by_op_without_jit_as_stock_keras(run):
    """compile(jit_compile=False) or run_eagerly=True: one tower's steps run
    uncompiled, as Keras-JAX's, so a layer may read its values; the numbers
    are stock's."""
    x = np.random.default_rng(0).normal(size=(12, 3)).astype("float32")
    y = np.random.default_rng(1).normal(size=(12, 2)).astype("float32")
    kwargs = {"jit_compile": False} if run.startswith("jit") else {"run_eagerly": True}
    results = []
    for base in (keras.Model, kt.TowerModel):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((3,))
        reader = _ReadsItsInput()
        model = base(inputs, keras.layers.Dense(2)(reader(inputs)))
        model.compile(optimizer="adam", loss="mse", **kwargs)
        history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, validation_data=(x, y))
        results.append((model.get_weights(), history.history, model.predict(x, verbose=0),
                        reader.sums))
    (want_weights, want_history, want_pred, want_sums), (weights, history, pred, sums) = results
    for got, want in zip(weights, want_weights):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    for key in want_history:
        np.testing.assert_allclose(history[key], want_history[key], rtol=1e-6)
    np.testing.assert_allclose(pred, want_pred, rtol=0, atol=1e-6)
    assert len(sums) >= 3 * 2 + 3   # every training, validation and predict step read its input
