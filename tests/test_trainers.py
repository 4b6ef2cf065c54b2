"""kt.Trainer: the loop around run_step(), its hooks, tower functions, and a
training without gradients (mini-batch k-means) with checkpoints."""

import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerastower as kt
from kerastower import backend as kt_backend
from conftest import TWO
from loop_cases import EventLog
from loop_cases import Hooks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from kmeans_digits import KMeans  # noqa: E402
from kmeans_digits import MiniBatchKMeansTrainer  # noqa: E402


class Counter(kt.TowerModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.total = self.add_weight(shape=(), initializer="zeros", trainable=False)


class KerasLog(keras.callbacks.Callback):
    def __init__(self, events):
        super().__init__()
        self.events = events

    def on_train_begin(self, logs=None):
        self.events.append(("on_train_begin",))

    def on_epoch_begin(self, epoch, logs=None):
        self.events.append(("on_epoch_begin", epoch))

    def on_train_batch_begin(self, batch, logs=None):
        self.events.append(("on_train_batch_begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.events.append(("on_train_batch_end", batch, dict(logs)))

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(("on_epoch_end", epoch, dict(logs)))

    def on_train_end(self, logs=None):
        self.events.append(("on_train_end",))


class TwoCallsTrainer(kt.Trainer):
    """Each step: one hooked run, one plain call; raises when told to."""

    def __init__(self, model, stop_at=None, fail_at=None):
        super().__init__(model)
        self.stop_at, self.fail_at = stop_at, fail_at
        self.plain_calls = 0
        self.seen = []

    def value(self):
        return {"value": float(self.global_step)}

    def run_step(self):
        self.seen.append((self.epoch_num, self.local_step, self.global_step))
        if self.global_step == self.stop_at:
            raise kt.StopTraining("enough")
        if self.global_step == self.fail_at:
            raise ValueError("broken step")
        self.hooked_run(self.value)
        self.plain_calls += 1


def expected_events(epochs, steps, stopped_at=None):
    events = [("before_train", 0, 0, 0)]
    step = 0
    for epoch in range(1, epochs + 1):
        events.append(("before_epoch", epoch, 0, step))
        for local in range(steps):
            if step == stopped_at:
                return events + [("after_train", epoch, local, step)]
            events += [
                ("before_run", epoch, local, step),
                ("after_run", epoch, local, step, float(step)),
                ("trigger_step", epoch, local + 1, step + 1),
            ]
            step += 1
        events += [("after_epoch", epoch, steps, step), ("trigger_epoch", epoch, steps, step)]
    return events + [("after_train", epochs, steps, step)]


def test_loop_calls_hooks_in_order_and_counts():
    events, keras_events = [], []
    trainer = TwoCallsTrainer(Counter())
    history = trainer.train(
        [EventLog(events), KerasLog(keras_events)], steps_per_epoch=3, max_epoch=2, verbose=0
    )
    assert events == expected_events(2, 3)
    # The plain call ran as often as the hooked one but triggered no hook.
    assert trainer.plain_calls == 6 and sum(e[0] == "after_run" for e in events) == 6
    assert trainer.seen == [(e, s, 3 * (e - 1) + s) for e in (1, 2) for s in range(3)]
    assert (trainer.global_step, trainer.epoch_num, trainer.local_step) == (6, 2, 3)
    expected_keras = [("on_train_begin",)]
    for epoch in range(2):
        expected_keras.append(("on_epoch_begin", epoch))
        for step in range(3):
            expected_keras += [
                ("on_train_batch_begin", step),
                ("on_train_batch_end", step, {"value": float(3 * epoch + step)}),
            ]
        # Epoch logs: the mean of each value over the epoch's steps.
        expected_keras.append(("on_epoch_end", epoch, {"value": 3 * epoch + 1.0}))
    assert keras_events == expected_keras + [("on_train_end",)]
    assert history.history == {"value": [1.0, 4.0]}


def test_fit_makes_each_step_function_call_a_hooked_run(two_towers):
    runs = []

    class Runs(kt.callbacks.Callback):
        def _before_run(self):
            runs.append(("before", self.global_step))

        def _after_run(self, outputs):
            runs.append(("after", self.global_step, None if outputs is None else sorted(outputs)))

    inputs = keras.Input((2,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    x = np.ones((48, 2), "float32")
    model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0, callbacks=[Runs()])
    # 48 examples / (2 towers x 4) = 6 steps, run 2 per call; a pass of known
    # length ends after its last step, with no call left to find no data (as
    # Keras). As under kt.Trainer, global_step counts the steps finished
    # before the run.
    assert runs == [r for step in (0, 2, 4) for r in (("before", step), ("after", step, ["loss"]))]


def test_training_continues_from_its_global_step_and_starting_epoch():
    events = []
    trainer = TwoCallsTrainer(Counter())
    trainer.train([EventLog(events)], steps_per_epoch=2, max_epoch=1, verbose=0)
    trainer.train([EventLog(events)], steps_per_epoch=2, starting_epoch=2, max_epoch=3, verbose=0)
    assert trainer.seen == [(1, 0, 0), (1, 1, 1), (2, 0, 2), (2, 1, 3), (3, 0, 4), (3, 1, 5)]


def test_stop_training_from_run_step_ends_cleanly():
    events = []
    trainer = TwoCallsTrainer(Counter(), stop_at=4)
    trainer.train([EventLog(events)], steps_per_epoch=3, max_epoch=5, verbose=0)
    assert events == expected_events(5, 3, stopped_at=4)
    assert trainer.global_step == 4


def test_stop_training_from_a_callback_ends_cleanly():
    class StopAfterEpoch2(kt.callbacks.Callback):
        def _trigger_epoch(self):
            if self.epoch_num == 2:
                raise kt.StopTraining()

    events = []
    trainer = TwoCallsTrainer(Counter())
    trainer.train([StopAfterEpoch2(), EventLog(events)], steps_per_epoch=2, max_epoch=9, verbose=0)
    assert trainer.global_step == 4
    # StopTraining from the first callback ends the loop at once: the next
    # callback gets no epoch end, only after_train.
    assert [e[0] for e in events[-3:]] == ["after_run", "trigger_step", "after_train"]


def test_a_failing_step_still_runs_after_train_and_raises():
    events = []
    trainer = TwoCallsTrainer(Counter(), fail_at=2)
    with pytest.raises(ValueError, match="broken step"):
        trainer.train([EventLog(events)], steps_per_epoch=3, max_epoch=2, verbose=0)
    assert events[-1] == ("after_train", 1, 2, 2)
    assert trainer.model.loop is not trainer.loop  # the model's fit loop is back


def test_keras_early_stopping_stops_the_trainer():
    class RisingLoss(kt.Trainer):
        def run_step(self):
            return {"loss": float(self.global_step)}

    trainer = RisingLoss(Counter())
    history = trainer.train(
        [keras.callbacks.EarlyStopping("loss", patience=1)], steps_per_epoch=2, max_epoch=10, verbose=0
    )
    assert history.history["loss"] == [0.5, 2.5]
    assert trainer.epoch_num == 2


def test_tower_function_gives_each_tower_its_own_batch(two_towers):
    class Ids(kt.Trainer):
        def run_step(self):
            return self.hooked_run(self.per_tower, self.next_batches())

        @kt.Trainer.tower_function(reduce=None)
        def per_tower(self, batch):
            ctx = kt.get_current_tower_context()
            return {"ids": batch, "tower": tf.constant(ctx.index), "training": tf.constant(ctx.is_training)}

    ids = tf.data.Dataset.range(100).batch(2)
    trainer = Ids(Counter(), kt.DatasetInput(ids))
    seen = []

    class Keep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(logs)

    trainer.train([Keep()], steps_per_epoch=3, max_epoch=1, verbose=0)
    # Tower k of step s took the (2s + k)-th batch: nothing split, nothing shared.
    assert [np.asarray(step["ids"]).tolist() for step in seen] == [
        [[4 * s, 4 * s + 1], [4 * s + 2, 4 * s + 3]] for s in range(3)
    ]
    assert all(np.asarray(step["tower"]).tolist() == [0, 1] for step in seen)
    assert all(np.asarray(step["training"]).tolist() == [True, True] for step in seen)
    assert trainer.loop.examples_seen == 12 and trainer.loop.tower_batches == [3, 3]


def test_tower_function_means_are_example_weighted(two_towers):
    class Means(kt.Trainer):
        def run_step(self):
            return self.hooked_run(self.mean, self.next_batches())

        @kt.Trainer.tower_function
        def mean(self, batch):
            return {"mean": tf.reduce_mean(tf.cast(batch, "float32"))}

    # Per-tower pipelines of unequal batches: tower 0 takes 1 example, tower 1 three.
    def per_tower(ctx):
        size = 1 + 2 * ctx.index
        return tf.data.Dataset.from_tensors(tf.fill([size], float(ctx.index * 10))).repeat()

    trainer = Means(Counter(), kt.DatasetInput(per_tower))
    history = trainer.train(steps_per_epoch=2, verbose=0)
    assert history.history["mean"] == [pytest.approx((0 * 1 + 10 * 3) / 4)]


def test_trainer_errors_say_what_to_do():
    with pytest.raises(TypeError, match="kt.TowerModel"):
        kt.Trainer(keras.Sequential([keras.layers.Dense(1)]))
    with pytest.raises(kt.InputSourceError, match="tf.data.Dataset"):
        kt.Trainer(Counter(), input=np.ones((4, 2)))
    with pytest.raises(NotImplementedError, match="override run_step"):
        kt.Trainer(Counter()).train(steps_per_epoch=1, verbose=0)
    with pytest.raises(ValueError, match="steps_per_epoch must be a positive int"):
        kt.Trainer(Counter(), train_op=lambda: None).train(verbose=0)

    class Takes(kt.Trainer):
        def run_step(self):
            self.not_a_dict(self.next_batches())

        @kt.Trainer.tower_function
        def not_a_dict(self, batch):
            return batch

    with pytest.raises(kt.KerasTowerError, match="must return a dict"):
        Takes(Counter(), tf.data.Dataset.range(4).batch(2).repeat()).train(steps_per_epoch=1, verbose=0)

    class CreatesVariable(Takes):
        @kt.Trainer.tower_function
        def not_a_dict(self, batch):
            return {"x": tf.Variable(1.0) * 2.0}

    with pytest.raises(kt.TowerRuleError, match="not_a_dict"):
        CreatesVariable(Counter(), tf.data.Dataset.range(4).batch(2).repeat()).train(
            steps_per_epoch=1, verbose=0)

    class Short(Takes):
        def run_step(self):
            self.next_batches()

    with pytest.raises(kt.InputSourceError, match=r"ran out at global step 2 .*\.repeat\(\)"):
        Short(Counter(), tf.data.Dataset.range(4).batch(2)).train(steps_per_epoch=5, verbose=0)


def test_tower_function_errors_and_overrides(two_towers):
    class Parent(kt.Trainer):
        def run_step(self):
            return self.hooked_run(self.values, self.next_batches())

        @kt.Trainer.tower_function
        def values(self, batch):
            return {"parent": tf.constant(1.0)}

    class Child(Parent):
        @kt.Trainer.tower_function
        def values(self, batch):
            # super()'s tower function is its own compiled function
            return {"child": tf.constant(2.0), **super().values.fn(batch)}

    child = Child(Counter(), tf.data.Dataset.range(8).batch(2).repeat())
    history = child.train(steps_per_epoch=1, verbose=0)
    assert history.history == {"child": [2.0], "parent": [1.0]}

    class NotABatchFirst(Parent):
        def run_step(self):
            return self.hooked_run(self.scaled, 2.0, self.next_batches())

        @kt.Trainer.tower_function
        def scaled(self, factor, batch):
            return {"x": factor * tf.cast(tf.reduce_sum(batch), "float32")}

    with pytest.raises(kt.KerasTowerError, match="first argument, which is not a batch"):
        NotABatchFirst(Counter(), tf.data.Dataset.range(8).batch(2).repeat()).train(
            steps_per_epoch=1, verbose=0)

    class OptimizerOnTrainer(Parent):
        def __init__(self, *args):
            super().__init__(*args)
            self.optimizer = keras.optimizers.Adam()

    with pytest.raises(kt.KerasTowerError, match=r"Set it on the model instead \(self.model.optimizer"):
        OptimizerOnTrainer(Counter(), tf.data.Dataset.range(8).batch(2).repeat()).train(
            steps_per_epoch=1, verbose=0)


def test_stop_training_from_after_train_is_clean():
    class StopLate(kt.callbacks.Callback):
        def _after_train(self):
            raise kt.StopTraining()

    trainer = TwoCallsTrainer(Counter())
    trainer.train([StopLate()], steps_per_epoch=2, verbose=0)
    assert trainer.global_step == 2


def test_subclass_constructors_leave_tower_model_alone():
    class PassesThrough(kt.TowerModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

    class TakesTwo(kt.TowerModel):
        def __init__(self, a, b, **kwargs):
            super().__init__(**kwargs)

    class ForwardsTwo(kt.TowerModel):
        def __init__(self, a, b, **kwargs):
            super().__init__(a, b, **kwargs)

    inputs = keras.Input((2,))
    outputs = keras.layers.Dense(1)(inputs)
    assert PassesThrough(inputs, outputs).outputs
    assert type(TakesTwo(1, 2)).__mro__[1] is kt.TowerModel
    with pytest.raises(TypeError, match="Name the first two parameters"):
        ForwardsTwo(inputs, outputs)
    assert kt.TowerModel.__bases__ == (kt_backend.tower_steps(), keras.Model)   # not made functional
    assert Counter().total.shape == ()


# ----------------------------------------------------------------------
# Training without gradients: mini-batch k-means.

CENTERS = np.array([[0.0, 0.0], [4.0, 0.0], [0.0, 4.0], [4.0, 4.0]], "float32")


def blobs():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, 2048)
    return (CENTERS[labels] + rng.normal(0, 0.3, (2048, 2))).astype("float32")


def kmeans_run(devices, batch, epochs, checkpoint_dir=None, callbacks=()):
    points = blobs()
    data = tf.data.Dataset.from_tensor_slices(points).shuffle(2048, seed=1).repeat().batch(batch)
    if checkpoint_dir:
        callbacks = [kt.callbacks.AutoResume(checkpoint_dir), kt.callbacks.ModelSaver(checkpoint_dir)] + list(callbacks)
    with kt.distributed("mirrored", devices=devices):
        model = KMeans(points[[0, 1, 2, 3]] + 1.0)
        trainer = MiniBatchKMeansTrainer(model, kt.DatasetInput(data))
        history = trainer.train(callbacks, steps_per_epoch=8, max_epoch=epochs, verbose=0)
    return trainer, history


@pytest.mark.parametrize("devices", [TWO[:1], TWO], ids=["1tower", "2towers"])
def test_kmeans_converges(devices):
    trainer, history = kmeans_run(devices, 64 // len(devices), epochs=4)
    centroids = trainer.model.centroids.numpy()
    nearest = np.linalg.norm(CENTERS[:, None] - centroids[None], axis=-1).min(axis=1)
    assert nearest.max() < 0.1, centroids
    inertia = history.history["inertia"]
    assert inertia[-1] < 0.5 * inertia[0] and inertia[-1] < 2 * 2 * 0.3**2, inertia


def test_kmeans_two_towers_equal_one_tower_on_the_joined_batches():
    one, _ = kmeans_run(TWO[:1], 32, epochs=2)
    two, _ = kmeans_run(TWO, 16, epochs=2)
    np.testing.assert_allclose(two.model.centroids.numpy(), one.model.centroids.numpy(), atol=1e-5)
    np.testing.assert_array_equal(two.model.counts.numpy(), one.model.counts.numpy())


def test_kmeans_resumes_from_a_checkpoint(tmp_path):
    straight, straight_history = kmeans_run(TWO, 16, epochs=3)
    kmeans_run(TWO, 16, epochs=1, checkpoint_dir=str(tmp_path))
    # A new process would build a new model and trainer: so do we.
    events = []
    resumed, resumed_history = kmeans_run(
        TWO, 16, epochs=3, checkpoint_dir=str(tmp_path), callbacks=[Hooks(events)]
    )
    assert resumed.global_step == straight.global_step == 24
    assert events[:2] == [("before_train", 0, 0, 8), ("before_epoch", 2, 0, 8)]
    np.testing.assert_array_equal(resumed.model.centroids.numpy(), straight.model.centroids.numpy())
    assert resumed_history.history["inertia"] == straight_history.history["inertia"][1:]
    assert [step for step, _ in kt.checkpoint.list_checkpoints(str(tmp_path))] == [8, 16, 24]


def test_resume_with_another_epoch_length_goes_on_from_the_input_position(tmp_path):
    kmeans_run(TWO, 16, epochs=2, checkpoint_dir=str(tmp_path))   # 16 steps of 8
    points = blobs()
    data = tf.data.Dataset.from_tensor_slices(points).shuffle(2048, seed=1).repeat().batch(16)
    events = []
    with kt.distributed("mirrored", devices=TWO):
        trainer = MiniBatchKMeansTrainer(KMeans(points[[0, 1, 2, 3]] + 1.0), kt.DatasetInput(data))
        trainer.train([kt.callbacks.AutoResume(str(tmp_path)), Hooks(events)],
                      steps_per_epoch=5, max_epoch=4, verbose=0)
    # Epochs 1-2 are done; 3 and 4 run, 5 steps each, from batch 16 of each tower on.
    assert [e[1] for e in events if e[0] == "before_epoch"] == [3, 4]
    assert trainer.global_step == 26 and trainer.loop.tower_batches == [26, 26]
