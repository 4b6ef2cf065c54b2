"""One strategy hierarchy and one registry on both backends (issue 56, must-have 2).

Every strategy `kt.distributed` makes is a `kt.TowerStrategy`, and a
strategy registered with `kt.register_strategy` trains on either backend:
a subclass of the backend's own strategy over the first two devices,
against one device on the joined batch.
"""

import keras
import numpy as np
import pytest

from tests.helpers.common import BACKEND
from tests.helpers.common import tower_devices

import kerastower as kt
from kerastower.strategies import switch


def _first_two(devices):
    """The backend's strategy over its first two devices, subclassed."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        class FirstTwo(kt.strategies.TFDistributeStrategy):
            pass

        return FirstTwo("first_two", tf.distribute.MirroredStrategy(
            tower_devices(2), cross_device_ops=tf.distribute.ReductionToOneDevice()))
    import jax
    from kerastower.strategies.jax_local import JaxTowerStrategy

    class FirstTwo(JaxTowerStrategy):
        pass

    return FirstTwo("first_two", jax.devices()[:2])


@pytest.fixture
def first_two():
    kt.register_strategy("first_two", _first_two)
    yield
    switch._REGISTRY[BACKEND].pop("first_two")


def _fit(x, y, batch_size, name=None):
    keras.utils.set_random_seed(1)

    def build():
        inputs = keras.Input((3,))
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(keras.layers.Dense(4, "tanh")(inputs)))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
        return model

    if name is None:
        return build()
    with kt.distributed(name) as strategy:
        return strategy, build()


def test_a_registered_strategy_trains_as_one_device_on_the_joined_batch(first_two):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True).astype("float32")
    assert "first_two" in kt.strategy_names()
    strategy, towers = _fit(x, y, 4, "first_two")
    assert type(strategy).__name__ == "FirstTwo" and isinstance(strategy, kt.TowerStrategy)
    assert towers.num_towers == 2 and towers.tower_strategy is strategy
    one = _fit(x, y, 8)
    for a, b in zip(towers.get_weights(), one.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["single", "mirrored"])
def test_every_built_in_strategy_is_a_tower_strategy(name):
    devices = tower_devices(1 if name == "single" else 2)
    with kt.distributed(name, devices=devices) as strategy:
        assert isinstance(strategy, kt.TowerStrategy)
    assert isinstance(kt.strategies.current_strategy(), kt.TowerStrategy)


def test_registering_needs_a_known_backend_and_a_callable():
    with pytest.raises(kt.StrategyError, match="backend must be one of 'tensorflow', 'jax'.*'torch'"):
        kt.register_strategy("mine", _first_two, backend="torch")
    with pytest.raises(kt.StrategyError, match="factory must be callable.*got 3"):
        kt.register_strategy("mine", 3)
    assert "mine" not in kt.strategy_names()


def test_the_base_takes_a_name_only_and_says_what_wraps_tf_distribute():
    with pytest.raises(kt.StrategyError, match="TFDistributeStrategy"):
        kt.TowerStrategy("mine", object())


def test_shard_optimizer_is_there_on_jax_and_refused_with_a_pointer_elsewhere():
    """`kt.distributed(..., shard_optimizer=True)` (docs/sharded-optimizer.md):
    JAX's "mirrored" has it; TensorFlow's strategies say where it exists
    when the block is entered, before anything is built."""
    block = kt.distributed("mirrored", devices=tower_devices(2), shard_optimizer=True)
    if BACKEND == "jax":
        with block as strategy:
            assert strategy.shards_optimizer_state
        return
    with pytest.raises(kt.StrategyError, match='exists under "single" and "mirrored" on JAX'):
        with block:
            pass
    assert not switch.open_blocks()


def test_shard_optimizer_takes_a_bool_only():
    """A string would be true whatever it says: refused, naming the value."""
    with pytest.raises(kt.ArgumentError, match="shard_optimizer must be True or False; got 'no'"):
        kt.distributed("mirrored", devices=tower_devices(2), shard_optimizer="no")
