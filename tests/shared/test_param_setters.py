"""Hyper-parameter setters change the variable the compiled step reads, on every tower."""

import keras
import numpy as np
import pytest

import kerastower as kt

from tests.helpers.common import endless
from tests.helpers.common import id_data
from tests.helpers.common import mlp
from tests.helpers.common import tower_copies


class LearningRates(kt.callbacks.Callback):
    """Records the learning rate in effect at each epoch and step."""

    def __init__(self):
        super().__init__()
        self.per_epoch, self.per_step = [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.per_epoch.append(float(self.model.optimizer.learning_rate.numpy()))

    def on_train_batch_begin(self, batch, logs=None):
        self.per_step.append(float(self.model.optimizer.learning_rate.numpy()))


def _data():
    x, y = id_data(32)
    x[:, 0] = 0.0
    return endless(x, y, 4)


def _lr_copies(model):
    return tower_copies(model.optimizer._learning_rate)


def test_scheduled_setter_piecewise_sets_every_tower_and_takes_effect(two_towers):
    model = mlp()
    rates = LearningRates()
    setter = kt.callbacks.ScheduledHyperParamSetter("learning_rate", [(1, 0.0), (3, 0.05)])
    before = [w.copy() for w in model.get_weights()]
    weights_after_epoch = []
    keep = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda e, logs: weights_after_epoch.append(model.get_weights()[0].copy()))
    model.fit(_data(), steps_per_epoch=2, epochs=4, verbose=0, callbacks=[setter, rates, keep])
    assert rates.per_epoch == pytest.approx([0.0, 0.0, 0.05, 0.05])
    assert _lr_copies(model) == pytest.approx([0.05, 0.05])
    # Learning rate 0 in epochs 1-2: the compiled step really read the variable.
    np.testing.assert_array_equal(weights_after_epoch[1], before[0])
    assert not np.allclose(weights_after_epoch[2], before[0])


def test_scheduled_setter_linear(two_towers):
    model = mlp()
    rates = LearningRates()
    linear = kt.callbacks.ScheduledHyperParamSetter(
        "learning_rate", [(1, 0.0), (5, 0.4)], interp="linear")
    model.fit(_data(), steps_per_epoch=1, epochs=6, verbose=0, callbacks=[linear, rates])
    assert rates.per_epoch == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4, 0.4])


def test_scheduled_setter_step_based(two_towers):
    model = mlp()
    rates = LearningRates()
    by_step = kt.callbacks.ScheduledHyperParamSetter(
        "learning_rate", [(0, 0.3), (3, 0.2)], step_based=True)
    model.fit(_data(), steps_per_epoch=2, epochs=3, verbose=0, callbacks=[by_step, rates])
    assert rates.per_step == pytest.approx([0.3, 0.3, 0.3, 0.2, 0.2, 0.2])


def test_a_step_based_value_reaches_the_towers_with_no_other_callback(two_towers):
    """Set between two steps, the value is what the next step trains with,
    also when no callback reads `self.model` (on JAX that read used to be
    what wrote the towers' state back, so the setter's value was lost)."""
    x, y = id_data(32)
    start = mlp().get_weights()

    def trained(steps, callbacks):
        model = mlp()
        model.set_weights(start)
        model.fit(endless(x, y, 4), steps_per_epoch=steps, epochs=1, verbose=0, callbacks=callbacks)
        return model.get_weights()

    stopped = kt.callbacks.ScheduledHyperParamSetter("learning_rate", [(0, 0.1), (2, 0.0)],
                                                     step_based=True)
    for a, b in zip(trained(4, [stopped]), trained(2, [])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_setter_with_func(two_towers):
    model = mlp(optimizer=keras.optimizers.SGD(0.8))
    rates = LearningRates()
    halve = kt.callbacks.HyperParamSetterWithFunc(
        "learning_rate", lambda epoch, lr: lr / 2 if epoch > 1 else lr)
    model.fit(_data(), steps_per_epoch=1, epochs=4, verbose=0, callbacks=[halve, rates])
    assert rates.per_epoch == pytest.approx([0.8, 0.4, 0.2, 0.1])


def test_stat_monitor_setter_acts_when_the_stat_stalls(two_towers):
    model = mlp(optimizer=keras.optimizers.SGD(0.0))  # the loss cannot improve
    model.knob = keras.Variable(0.0, trainable=False, name="knob")
    knob_per_epoch = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda e, logs: knob_per_epoch.append(float(model.knob.numpy())))
    monitor = kt.callbacks.StatMonitorParamSetter(
        "knob", "loss", lambda v: v + 1.0, threshold=0.01, last_k=2)
    model.fit(_data(), steps_per_epoch=1, epochs=7, verbose=0, callbacks=[monitor, record])
    # Stalled: changed after epoch 3 (2 epochs without improvement), then waits 2 epochs.
    assert knob_per_epoch == [0.0, 0.0, 0.0, 1.0, 1.0, 2.0, 2.0]


def test_model_variable_param_and_bad_params(two_towers):
    model = mlp(optimizer=keras.optimizers.Adam(0.01))
    model.noise_scale = keras.Variable(1.0, trainable=False, name="noise_scale")
    setter = kt.callbacks.ScheduledHyperParamSetter("noise_scale", [(1, 0.5), (2, 0.25)])
    model.fit(_data(), steps_per_epoch=1, epochs=2, verbose=0, callbacks=[setter])
    assert float(model.noise_scale.numpy()) == 0.25
    with pytest.raises(ValueError, match=r"optimizer.beta_1 is 0.9, a Python value baked"):
        model.fit(_data(), steps_per_epoch=1, verbose=0,
                  callbacks=[kt.callbacks.ScheduledHyperParamSetter("beta_1", [(1, 0.5)])])
    with pytest.raises(ValueError, match="No hyper-parameter named 'lr_typo'"):
        model.fit(_data(), steps_per_epoch=1, verbose=0,
                  callbacks=[kt.callbacks.HyperParamSetterWithFunc("lr_typo", lambda e, v: v)])
    with pytest.raises(ValueError, match="sorted by epoch"):
        kt.callbacks.ScheduledHyperParamSetter("learning_rate", [(3, 0.1), (1, 0.2)])


def test_a_watched_stat_missing_from_the_logs_is_named(two_towers):
    model = mlp()
    monitor = kt.callbacks.StatMonitorParamSetter("learning_rate", "val_loss", lambda v: v, 0.0, 1)
    with pytest.raises(KeyError, match=r"watches 'val_loss', which is not in the epoch logs \['accuracy', 'loss'\]"):
        model.fit(_data(), steps_per_epoch=1, verbose=0, callbacks=[monitor])
