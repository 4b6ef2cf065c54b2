"""The strategy decorator: one line switches where the towers run."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerastower as kt
from tests.tensorflow.helpers import TWO, id_data, mlp


def test_unknown_strategy_name_lists_the_valid_ones():
    with pytest.raises(kt.StrategyError) as error:
        kt.distributed("horovd")
    message = str(error.value)
    assert "'horovd'" in message
    for name in ("'central'", "'mirrored'", "'single'"):
        assert name in message


def test_the_jax_multihost_name_on_tensorflow_points_to_multiworker():
    with pytest.raises(kt.StrategyError, match='JAX backend.*"multiworker" or "horovod"'):
        kt.distributed("multihost")


def test_decorator_and_context_manager_are_the_same_object():
    switch = kt.distributed("mirrored", devices=TWO)

    @switch
    def towers_inside():
        return mlp().num_towers, kt.strategies.current_strategy().name

    assert towers_inside() == (2, "mirrored")
    with switch as strategy:
        assert strategy.num_towers == 2 and mlp().num_towers == 2
    assert kt.strategies.current_strategy().name == "single"
    assert mlp().num_towers == 1


def test_central_raises_and_says_why_and_what_to_use():
    with pytest.raises(kt.StrategyError, match=r"does not work with Keras 3.*Use \"mirrored\""):
        kt.distributed("central", devices=TWO).strategy


def test_default_mirrored_devices_are_all_logical_cpus():
    with kt.distributed("mirrored") as strategy:
        assert strategy.num_towers == 4


def test_single_refuses_several_devices():
    with pytest.raises(kt.StrategyError, match='Use "mirrored"'):
        kt.distributed("single", devices=TWO).strategy


def test_model_created_outside_the_strategy_is_refused_with_advice():
    x, y = id_data(8)
    model = mlp()
    with kt.distributed("mirrored", devices=TWO):
        with pytest.raises(kt.StrategyError, match="Create the model inside the same"):
            model.fit(x, y, verbose=0)


def test_plain_tf_distribute_scope_works_too():
    x, y = id_data(16)
    strategy = tf.distribute.MirroredStrategy(
        TWO, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    with strategy.scope():
        model = mlp()
        model.fit(x, y, batch_size=4, verbose=0)
    assert model.num_towers == 2


def test_register_strategy_adds_a_name():
    kt.register_strategy("two_cpus", lambda devices: kt.strategies.mirrored._make_mirrored(TWO))
    try:
        assert "two_cpus" in kt.strategy_names()
        with kt.distributed("two_cpus") as strategy:
            assert strategy.num_towers == 2
    finally:
        kt.strategies.switch._REGISTRY["tensorflow"].pop("two_cpus")


def test_non_finite_check_sees_the_reduced_gradient(two_towers):
    """Tower 1's batch makes its gradient inf; tower 0's is fine. The reduced
    gradient is not finite, so LossScaleOptimizer skips the step on every
    tower and halves its scale (stock Keras checks replica 0's share only)."""

    def pipeline(ctx):
        x = np.ones((4, 4), "float32")
        if ctx.index == 1:
            x[0, 0] = np.inf
        return tf.data.Dataset.from_tensors((x, np.zeros((4,), "int32")))

    optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=1024.0
    )
    model = mlp(optimizer=optimizer)
    before = [w.copy() for w in model.get_weights()]
    model.fit(kt.DatasetInput(pipeline), verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert float(optimizer.dynamic_scale.numpy()) == 512.0


def test_two_switches_of_the_same_kind_are_told_apart_in_the_error():
    x, y = id_data(8)
    with kt.distributed("mirrored", devices=TWO):
        model = mlp()
    with kt.distributed("mirrored", devices=TWO):
        with pytest.raises(kt.StrategyError, match="another object of the same kind"):
            model.fit(x, y, verbose=0)


_CPU_TOWERS_SCRIPT = """
import keras, numpy as np, kerastower as kt
devices = kt.use_cpu_towers(2)
with kt.distributed("mirrored", devices=devices) as strategy:
    inputs = keras.Input((3,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((8, 3), "float32"), np.ones((8, 1), "float32"), batch_size=2, verbose=0)
assert strategy.num_towers == 2 and model.optimizer.iterations.numpy() == 2, devices
assert kt.use_cpu_towers(2) == devices  # TensorFlow has started: the same devices
try:
    kt.use_cpu_towers(3)
except kt.StrategyError as error:
    print("REFUSED:", error)
"""


def test_use_cpu_towers_splits_the_cpu_in_a_fresh_process():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _CPU_TOWERS_SCRIPT], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REFUSED: use_cpu_towers(3): TensorFlow has already started with 2 CPU" in result.stdout


def test_a_strategy_only_places_reduces_and_broadcasts():
    """Taking a step's batches is the engine's (backend/tensorflow/feeding.py),
    not the strategy's. The input methods strategies had stay one release,
    deprecated: `distribute` is `place_input`; a custom strategy overriding
    `next_step`, which kerastower no longer calls, is refused at once rather
    than silently skipped."""
    with pytest.raises(kt.StrategyError, match="next_step.*any_process_has"):
        class OldStyle(kt.strategies.TFDistributeStrategy):
            def next_step(self, iterator, endless=False):
                return None
    with pytest.warns(DeprecationWarning, match="place_input"):
        class OldPlacing(kt.strategies.TFDistributeStrategy):
            def distribute(self, dataset_fn, per_tower):
                return ("placed by", per_tower)
    assert OldPlacing("old", None).place_input(None, True) == ("placed by", True)
    with kt.distributed("mirrored", devices=TWO) as strategy:
        def dataset_fn(context):
            return tf.data.Dataset.range(4).batch(2)
        with pytest.warns(DeprecationWarning, match="place_input"):
            placed = strategy.distribute(dataset_fn, per_tower=False)
        assert type(placed) is type(strategy.place_input(dataset_fn, per_tower=False))


def test_clear_session_inside_a_block_keeps_its_strategy():
    """keras-tuner calls keras.backend.clear_session() before every trial:
    the block's strategy is in effect after it, and leaving the block works,
    also where `tensorflow.compat.v1` was imported by name (which rebinds
    `tf.compat.v1` to a new module object, as Keras's own tests do)."""
    import tensorflow.compat.v1  # noqa: F401

    x, y = id_data(32)
    with kt.distributed("mirrored", devices=TWO) as strategy:
        keras.backend.clear_session()
        assert tf.distribute.get_strategy() is strategy.tf_strategy
        model = mlp()
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        assert model.num_towers == 2 and model.loop.global_step == 2
    assert not tf.distribute.has_strategy()


def test_an_error_in_a_block_whose_scope_was_lost_is_reported_as_itself():
    # TensorFlow's own reset, taken before a block patches it: the block's
    # scope is lost as a reset by some other path would lose it.
    reset_unpatched = tf.compat.v1.reset_default_graph

    with pytest.warns(UserWarning, match="failed to close too"):
        with pytest.raises(ValueError, match="the block's own error"):
            with kt.distributed("mirrored", devices=TWO):
                reset_unpatched()
                raise ValueError("the block's own error")
    with pytest.raises(kt.StrategyError, match="could not be closed"):
        with kt.distributed("mirrored", devices=TWO):
            reset_unpatched()
    assert not tf.distribute.has_strategy()
