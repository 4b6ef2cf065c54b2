"""Private Keras/TF APIs live in the kerastower/_compat package and fail loudly."""

import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerastower as kt
from kerastower import _compat

from tests.helpers.common import ROOT

PACKAGE = os.path.join(ROOT, "kerastower")


def test_a_missing_private_api_raises_an_error_naming_it_and_the_versions():
    with pytest.raises(kt.KerasTowerError) as error:
        _compat.require("keras.src.trainers.data_adapters.data_adapter_utils", "gone_in_keras_9")
    message = str(error.value)
    assert "data_adapter_utils.gone_in_keras_9" in message
    assert keras.__version__ in message and tf.__version__ in message


def test_a_missing_private_model_member_raises_instead_of_being_skipped():
    class NotAKerasModel:
        """Has none of keras.Model's private members."""

    with pytest.raises(kt.KerasTowerError, match="_loss_tracker"):
        _compat.loss_tracker(NotAKerasModel())
    with pytest.raises(kt.KerasTowerError, match="_compute_loss"):
        _compat.compute_loss(NotAKerasModel(), x=None, y=None, y_pred=None)


def test_a_variable_without_its_stored_array_raises_instead_of_being_skipped():
    from kerastower._compat import on_jax

    variable = keras.Variable(np.ones(2, "float32"))
    assert on_jax.stored_values([variable])[0] is variable.value
    with pytest.raises(kt.KerasTowerError, match="Variable._value"):
        on_jax.stored_values([object()])


def test_no_module_but_compat_names_private_keras_or_tensorflow():
    # An import, or a module name given to importlib: either reaches inside.
    # Whole names only: kerastower.backend.tensorflow.python_input is ours.
    private = re.compile(r"(?<![\w.])(keras\.src|tensorflow\.python)\b")
    compat = os.path.join(PACKAGE, "_compat")
    offenders = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and not path.startswith(compat + os.sep):
                with open(path) as f:
                    if private.search(f.read()):
                        offenders.append(os.path.relpath(path, PACKAGE))
    assert offenders == []


def test_the_patches_leave_keras_unchanged_outside_towers():
    """Stock Keras under MirroredStrategy still divides its losses by the
    replicas: kerastower changes them inside its own towers only."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    loss = keras.losses.MeanSquaredError()

    def in_replica():
        return loss(tf.ones([4, 1]), tf.zeros([4, 1]))

    values = strategy.experimental_local_results(strategy.run(in_replica))
    assert [float(v) for v in values] == [0.5, 0.5]


def test_keras_is_patched_only_while_a_tower_runs():
    """The tower patches are entered by each tower and left after it: before
    and after a 2-tower fit, Keras's loss scaling and optimizers are its
    own functions (they used to be replaced for good at import)."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.losses import loss as loss_module
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    def current():
        return (BaseOptimizer.apply, LossScaleOptimizer.apply, TFOptimizer._all_reduce_sum_gradients,
                loss_module.scale_loss_for_distribution, loss_module.unscale_loss_for_distribution)

    before = current()
    assert not any(hasattr(f, "_kerastower_original") for f in before)
    seen_in_tower = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            seen_in_tower.append(BaseOptimizer.apply is not before[0])
            return x

    with kt.distributed("mirrored", devices=["/cpu:0", "/cpu:1"]):
        inputs = keras.Input((3,))
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(Probe()(inputs)))
        model.compile(optimizer="sgd", loss="mse")
        model.fit(np.ones((16, 3)), np.ones((16, 1)), batch_size=4, verbose=0)
    assert any(seen_in_tower)   # patched while the towers were traced
    assert current() == before
