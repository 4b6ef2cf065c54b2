"""What the trainer tests of both backends share: recorders of the loop's
hooks, a small GAN, and a trainer whose only state is a counter.

Backend-neutral (Keras and kerastower only): tests/ imports it on
TensorFlow, tests/jax/ on JAX.
"""

import time

import keras
import pytest

import kerastower as kt


class EventLog(kt.callbacks.Callback):
    """Records every kt hook, with where the loop was."""

    def __init__(self, events):
        super().__init__()
        self.events = events

    def _log(self, name, *extra):
        self.events.append((name, self.epoch_num, self.local_step, self.global_step) + extra)

    def _before_train(self):
        self._log("before_train")

    def _before_epoch(self):
        self._log("before_epoch")

    def _before_run(self):
        self._log("before_run")

    def _after_run(self, outputs):
        self._log("after_run", outputs["value"])

    def _trigger_step(self):
        self._log("trigger_step")

    def _after_epoch(self):
        self._log("after_epoch")

    def _trigger_epoch(self):
        self._log("trigger_epoch")

    def _after_train(self):
        self._log("after_train")


class Hooks(EventLog):
    """EventLog for any step's outputs."""

    def _after_run(self, outputs):
        self._log("after_run")


def keras_recorder(events):
    """A Keras callback appending each of its calls to `events`."""
    return keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda e, logs: events.append(("keras_epoch_begin", e)),
        on_train_batch_begin=lambda b, logs: events.append(("keras_batch_begin", b)),
        on_train_batch_end=lambda b, logs: events.append(("keras_batch_end", b)),
        on_epoch_end=lambda e, logs: events.append(("keras_epoch_end", e, sorted(logs))),
        on_train_end=lambda logs: events.append(("keras_train_end",)),
    )


def loop_events(epochs, steps):
    """The kt hooks of a run of `epochs` x `steps` iterations: tensorpack's loop."""
    expected = [("before_train", 0, 0, 0)]
    for epoch in range(1, epochs + 1):
        done = steps * (epoch - 1)
        expected.append(("before_epoch", epoch, 0, done))
        for step in range(steps):
            expected += [("before_run", epoch, step, done + step), ("after_run", epoch, step, done + step),
                         ("trigger_step", epoch, step + 1, done + step + 1)]
        expected += [("after_epoch", epoch, steps, steps * epoch), ("trigger_epoch", epoch, steps, steps * epoch)]
    return expected + [("after_train", epochs, steps, steps * epochs)]


class NoiseFromInput(kt.GANModel):
    """Takes its noise from the input, (real, noise), so that runs with any
    number of towers see the same numbers."""

    def real_samples(self, data):
        return data[0]

    def sample_noise(self, data):
        return data[1]


def tiny_gan(cls=kt.GANModel):
    """A compiled 4 -> 8 -> 3 generator against a 3 -> 8 -> 1 discriminator."""
    keras.utils.set_random_seed(7)
    generator = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
    )
    discriminator = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    gan = cls(generator, discriminator, seed=3)
    gan.compile(
        g_optimizer=keras.optimizers.Adam(1e-2, beta_1=0.5),
        d_optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
    )
    return gan


class OneStepTrainer(kt.Trainer):
    """Each step adds 1 to a variable and logs it as the loss."""

    def _setup(self):
        self.value = self.add_variable("value")

    def run_step(self):
        return self.hooked_run(self.step)

    def step(self):
        self.value.assign_add(1.0)
        return {"loss": float(self.value.numpy())}


def check_trainer_hooks_match(fit_events, devices):
    """A OneStepTrainer's run of 2 epochs x 3 steps on `devices` calls the
    kt and Keras hooks as `fit_events` (a fit of that length) recorded,
    in tensorpack's order."""
    events = []
    with kt.distributed("mirrored", devices=devices):
        trainer = OneStepTrainer()
    trainer.train(callbacks=[Hooks(events), keras_recorder(events)], steps_per_epoch=3, max_epoch=2, verbose=0)
    assert events == fit_events
    assert [e for e in fit_events if not e[0].startswith("keras")] == loop_events(2, 3)


class NoiseProbe(kt.GANTrainer):
    """Each step: a plain call of generate(), then each tower's first noise value."""

    def run_step(self):
        self.model.generate(4)   # a plain call, e.g. to look at samples
        return self.first_noise(self.next_batches())

    @kt.Trainer.tower_function(reduce=None)
    def first_noise(self, data):
        return {"noise": self.model.sample_noise(data)[0, 0]}


class Counter(kt.Trainer):
    """A trainer without a model: its state is one variable."""

    def _setup(self):
        self.count = self.add_variable("count")

    def run_step(self):
        self.count.assign_add(self.global_step + 1.0)
        return {"count": float(self.count.numpy())}


def check_counter_checkpoints_and_resumes(checkpoint_dir):
    """A Counter's run of 2 epochs, resumed to 3 from its checkpoints, ends
    where one of 3 would, with the third epoch's logs."""
    first = Counter()
    first.train(callbacks=[kt.callbacks.ModelSaver(checkpoint_dir)], steps_per_epoch=3, max_epoch=2, verbose=0)
    assert float(first.count.numpy()) == sum(range(1, 7))
    resumed = Counter()
    history = resumed.train(
        callbacks=[kt.callbacks.AutoResume(checkpoint_dir), kt.callbacks.ModelSaver(checkpoint_dir)],
        steps_per_epoch=3, max_epoch=3, verbose=0)
    assert resumed.global_step == 9
    assert float(resumed.count.numpy()) == sum(range(1, 10))
    assert history.history["count"] == [pytest.approx((28 + 36 + 45) / 3)]


def resumable_run(checkpoint_dir, slow, devices, seconds_a_step):
    """The resume scripts' model and callbacks, made on `devices`: Dense,
    Dropout and BatchNormalization with Adam, AutoResume and a ModelSaver
    every 2 steps (and with `slow`, a sleep after every step, so that a
    test can kill the run mid-epoch). Returns (model, callbacks, the AutoResume)."""

    class Slow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(seconds_a_step)

    with kt.distributed("mirrored", devices=devices):
        inputs = keras.Input((6,))
        h = keras.layers.Dense(16, activation="relu")(inputs)
        h = keras.layers.Dropout(0.25)(h)
        h = keras.layers.BatchNormalization()(h)
        model = kt.TowerModel(inputs, keras.layers.Dense(3)(h))
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    resume = kt.callbacks.AutoResume(checkpoint_dir)
    callbacks = [resume, kt.callbacks.PeriodicTrigger(kt.callbacks.ModelSaver(checkpoint_dir), every_k_steps=2)]
    return model, callbacks + ([Slow()] if slow else []), resume
