"""kt.Trainer on TensorFlow: tower functions over kt.DatasetInput and
tf.data inputs (kt.Trainer on TensorFlow takes a kt.InputSource or a
tf.data.Dataset; on JAX a Python generator: tests/jax/test_jax_trainers.py),
their errors, and a training without gradients (mini-batch k-means) with
checkpoints. The loop both backends share is tests/shared/test_trainers.py."""


import keras
import numpy as np
import pytest
import tensorflow as tf

import kerastower as kt
from tests.tensorflow.helpers import TWO
from tests.helpers.loop_cases import Hooks

from tests.helpers.examples import import_example

KMeans = import_example("kmeans_digits").KMeans
MiniBatchKMeansTrainer = import_example("kmeans_digits").MiniBatchKMeansTrainer


class Counter(kt.TowerModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.total = self.add_weight(shape=(), initializer="zeros", trainable=False)


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
    # Those of both backends: tests/shared/test_trainers.py.
    with pytest.raises(kt.InputSourceError, match="tf.data.Dataset"):
        kt.Trainer(Counter(), input=np.ones((4, 2)))

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
