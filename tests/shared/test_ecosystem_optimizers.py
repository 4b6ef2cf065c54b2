"""Optimizers a model keeps in a list or a dict, as a CycleGAN keeps its four.

`kt.minimize` and the checkpoints find them as they find optimizers held
as attributes; 2 towers equal one device on the joined batch; an optimizer
the model does not hold is named in a kerastower error.
"""

import keras
import numpy as np
import pytest
from keras import ops

import kerastower as kt

from tests.helpers.common import BACKEND
from tests.helpers.common import tower_devices
from kerastower.checkpoint.training_state import training_optimizers
from kerastower.checkpoint.training_state import training_state

ROWS = 32


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 2)).astype("float32")
    return x, (x[:, ::-1] * 2.0).copy()


def _batches(batch):
    x, y = _data()
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()
    return ((x[i:i + batch], y[i:i + batch]) for _ in iter(int, 1) for i in range(0, ROWS, batch))


class Cycle(kt.TowerModel):
    """Two mappings and two critics, each with its own optimizer, the four
    held as the model holds them in `holding`: a list, or a list and a dict."""

    def __init__(self, holding, **kwargs):
        super().__init__(**kwargs)
        self.nets = [keras.layers.Dense(2, kernel_initializer=keras.initializers.GlorotUniform(seed=i))
                     for i in range(4)]
        optimizers = [keras.optimizers.Adam(0.01, name="adam_g"), keras.optimizers.SGD(0.1, name="sgd_f"),
                      keras.optimizers.Adam(0.02, name="adam_dx"),
                      keras.optimizers.SGD(0.05, momentum=0.9, name="sgd_dy")]
        if holding == "list":
            self.cycle_optimizers = optimizers
        else:
            self.generator_optimizers = optimizers[:2]
            self.critic_optimizers = {"x": optimizers[2], "y": optimizers[3]}

    def optimizer_of(self, k):
        if hasattr(self, "cycle_optimizers"):
            return self.cycle_optimizers[k]
        return self.generator_optimizers[k] if k < 2 else self.critic_optimizers["xy"[k - 2]]

    def all_optimizers(self):
        return [self.optimizer_of(k) for k in range(4)]


class CycleTrainer(kt.Trainer):
    def _setup(self):
        for net, optimizer in zip(self.model.nets, self.model.all_optimizers()):
            net.build((None, 2))
            optimizer.build(net.trainable_variables)

    def run_step(self):
        return self.hooked_run(self.cycle_step, self.next_batches())

    @kt.Trainer.tower_function
    def cycle_step(self, batch):
        x, y = batch
        model, logs = self.model, {}
        pairs = [(x, y), (y, x), (x, x), (y, y)]
        for k, (net, (source, target)) in enumerate(zip(model.nets, pairs)):
            def loss(net=net, source=source, target=target):
                return ops.mean(ops.square(net(source) - target))
            logs[f"loss{k}"] = kt.minimize(model.optimizer_of(k), loss, net.trainable_variables)
        return logs


def _train(holding, num_towers, batch):
    with kt.distributed("mirrored", devices=tower_devices(num_towers)):
        model = Cycle(holding)
        history = CycleTrainer(model, _batches(batch)).train(steps_per_epoch=3, max_epoch=2, verbose=0)
    return model, history.history


@pytest.mark.parametrize("holding", ["list", "list and dict"])
def test_optimizers_in_containers_train_two_towers_as_one_device_on_the_joined_batch(holding):
    towers, tower_logs = _train(holding, 2, 4)
    one, one_logs = _train(holding, 1, 8)
    assert [o.name for o in training_optimizers(towers)] == (
        ["adam_g", "sgd_f", "adam_dx", "sgd_dy"] if holding == "list"
        else ["adam_dx", "sgd_dy", "adam_g", "sgd_f"])  # in attribute-name order
    for optimizer in towers.all_optimizers():
        assert int(optimizer.iterations.numpy()) == 6
    # Every optimizer's slots are in what a checkpoint keeps.
    kept = {id(v) for v in training_state(towers)}
    assert all(id(v) in kept for o in towers.all_optimizers() for v in o.variables)
    for got, want in zip(towers.get_weights(), one.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for key in one_logs:
        np.testing.assert_allclose(tower_logs[key], one_logs[key], rtol=1e-5, atol=1e-6)


def test_an_optimizer_the_model_does_not_hold_is_named():
    stray = keras.optimizers.SGD(0.1, name="stray_sgd")   # held by no model

    class Forgetful(Cycle):
        def optimizer_of(self, k):
            return stray if k == 1 else super().optimizer_of(k)

        def all_optimizers(self):
            return list(self.cycle_optimizers)

    class Trainer(CycleTrainer):
        def _setup(self):
            super()._setup()
            stray.build(self.model.nets[1].trainable_variables)

    with kt.distributed("mirrored", devices=tower_devices(2)):
        model = Forgetful("list")
        with pytest.raises(kt.KerasTowerError, match="'stray_sgd'.*does not hold"):
            Trainer(model, _batches(4)).train(steps_per_epoch=1, max_epoch=1, verbose=0)
