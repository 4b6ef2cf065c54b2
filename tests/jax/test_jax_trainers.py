"""kt.Trainer on JAX: fit's loop and hooks, tower functions (each tower its
own batch, reduced as on TensorFlow), optimizer steps averaged over towers,
GAN trainers equal on N towers and one, checkpoints and exact resume.
(The loop and hooks both backends share: tests/shared/test_trainers.py.)"""

import itertools

import jax
import keras
import numpy as np
import pytest

import kerastower as kt
from tests.helpers.loop_cases import NoiseFromInput
from tests.helpers.loop_cases import NoiseProbe
from tests.helpers.loop_cases import tiny_gan

ONE, TWO, FOUR = (jax.devices()[:n] for n in (1, 2, 4))


def endless(batches):
    """An endless generator over a list of batches."""
    return (batches[i % len(batches)] for i in itertools.count())


class Probe(kt.Trainer):
    """Runs one tower function, chosen by name, on the step's batches."""

    def __init__(self, input, function):
        super().__init__(input=input)
        self.function = function
        self.outputs = []

    def run_step(self):
        self.outputs.append(self.hooked_run(getattr(self, self.function), self.next_batches()))

    @kt.Trainer.tower_function(reduce=None)
    def per_tower(self, batch):
        ctx = kt.get_current_tower_context()
        return {"first": batch[0, 0], "index": ctx.index, "total": ctx.total, "rows": batch.shape[0]}

    @kt.Trainer.tower_function
    def mean(self, batch):
        return {"mean": keras.ops.mean(batch)}

    @kt.Trainer.tower_function(reduce="sum")
    def total(self, batch):
        return {"sum": keras.ops.sum(batch), "rows": batch.shape[0]}


def _numbered(rows=2):
    """Batch i holds the number i."""
    return (np.full((rows, 3), float(i), "float32") for i in itertools.count())


def test_each_tower_takes_its_own_batch_in_order():
    with kt.distributed("mirrored", devices=FOUR):
        trainer = Probe(_numbered(), "per_tower")
    trainer.train(steps_per_epoch=2, max_epoch=1, verbose=0)
    assert [np.asarray(o["first"]).tolist() for o in trainer.outputs] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [np.asarray(o["index"]).tolist() for o in trainer.outputs] == [[0, 1, 2, 3]] * 2
    assert [np.asarray(o["total"]).tolist() for o in trainer.outputs] == [[4] * 4] * 2
    assert trainer.loop.tower_batches == [2, 2, 2, 2] and trainer.loop.examples_seen == 16


def test_means_are_example_weighted_and_sums_add_up():
    with kt.distributed("mirrored", devices=TWO):
        means = Probe(_numbered(), "mean")
        sums = Probe(_numbered(), "total")
    means.train(steps_per_epoch=3, max_epoch=1, verbose=0)
    sums.train(steps_per_epoch=3, max_epoch=1, verbose=0)
    assert [float(o["mean"]) for o in means.outputs] == [0.5, 2.5, 4.5]
    assert [float(o["sum"]) for o in sums.outputs] == [6.0, 30.0, 54.0]
    assert [int(o["rows"]) for o in sums.outputs] == [4, 4, 4]

    def uneven():  # 1 row then 3 rows: the step runs joined, as one tower
        while True:
            yield np.zeros((1, 3), "float32")
            yield np.ones((3, 3), "float32")

    with kt.distributed("mirrored", devices=TWO):
        joined = Probe(uneven(), "mean")
    joined.train(steps_per_epoch=1, max_epoch=1, verbose=0)
    assert float(joined.outputs[0]["mean"]) == 0.75   # (0 * 1 + 1 * 3) / 4, not (0 + 1) / 2


class Linear(kt.TowerModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)

    def call(self, x, training=False):
        return self.dense(x)


class Regression(Linear):
    """Linear behind a synchronized BatchNormalization: its moments are every tower's."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.BatchNormalization(synchronized=True)

    def call(self, x, training=False):
        return self.dense(self.norm(x, training=training))


class RegressionTrainer(kt.Trainer):
    def _setup(self):
        self.model(np.zeros((1, 3), "float32"))
        self.model.optimizer.build(self.model.trainable_variables)

    def run_step(self):
        return self.hooked_run(self.fit_batch, self.next_batches())

    @kt.Trainer.tower_function
    def fit_batch(self, batch):
        x, y = batch

        def loss():
            return keras.ops.mean(keras.ops.square(self.model(x, training=True) - y))

        return {"loss": kt.minimize(self.model.optimizer, loss, self.model.trainable_variables)}


def _regression_batches(per_tower, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(96, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.3).astype("float32")
    steps = len(x) // per_tower
    return (tuple(a[(i % steps) * per_tower:(i % steps + 1) * per_tower] for a in (x, y))
            for i in itertools.count())


def _regression(devices, per_tower, optimizer, steps=6):
    keras.utils.set_random_seed(5)
    with kt.distributed("mirrored", devices=devices):
        model = Regression()
        model.compile(optimizer=optimizer)
        history = RegressionTrainer(model, _regression_batches(per_tower)).train(
            steps_per_epoch=steps // 2, max_epoch=2, verbose=0)
    return model, history.history


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("devices", [TWO, FOUR], ids=["2towers", "4towers"])
def test_minimize_in_towers_equals_one_device_on_the_joined_batch(devices, optimizer):
    one, one_logs = _regression(ONE, 4 * len(devices), optimizer)
    many, many_logs = _regression(devices, 4, optimizer)
    assert not np.allclose(one.dense.kernel.numpy(), 0.0)
    for a, b in zip(one.variables, many.variables):   # weights and BN moving statistics
        np.testing.assert_allclose(np.asarray(b.value), np.asarray(a.value), atol=1e-5, err_msg=a.path)
    np.testing.assert_allclose(many_logs["loss"], one_logs["loss"], atol=1e-5)
    assert int(many.optimizer.iterations.numpy()) == 6


class KMeans(kt.TowerModel):
    """k centroids moved by mini-batch k-means (training without gradients)."""

    def __init__(self, initial, **kwargs):
        super().__init__(**kwargs)
        self.centroids = self.add_weight(shape=initial.shape, trainable=False, name="centroids",
                                         initializer=keras.initializers.Constant(initial))
        self.counts = self.add_weight(shape=initial.shape[:1], initializer="zeros",
                                      trainable=False, name="counts")


class KMeansTrainer(kt.Trainer):
    def run_step(self):
        sums = self.hooked_run(self.assign_points, self.next_batches())
        model = self.model
        total = model.counts + sums["counts"]
        moved = model.centroids + (sums["sums"] - sums["counts"][:, None] * model.centroids) / (
            keras.ops.maximum(total, 1.0)[:, None])
        model.centroids.assign(moved)
        model.counts.assign(total)
        return {"inertia": sums["inertia"] / sums["points"]}

    @kt.Trainer.tower_function(reduce="sum", training=False)
    def assign_points(self, points):
        centroids = self.model.centroids
        distances = keras.ops.sum((points[:, None, :] - centroids[None]) ** 2, axis=-1)
        nearest = keras.ops.one_hot(keras.ops.argmin(distances, axis=1), centroids.shape[0])
        return {"sums": keras.ops.matmul(keras.ops.transpose(nearest), points),
                "counts": keras.ops.sum(nearest, axis=0),
                "inertia": keras.ops.sum(keras.ops.min(distances, axis=1)),
                "points": float(points.shape[0])}


CENTERS = np.array([[0, 0], [3, 0], [0, 3], [3, 3]], "float32")


def _kmeans(devices, per_tower, epochs, checkpoint_dir=None):
    rng = np.random.default_rng(0)
    points = (CENTERS[rng.integers(0, 4, 1024)] + rng.normal(0, 0.3, (1024, 2))).astype("float32")
    batches = (points[(i * per_tower) % 1024:][:per_tower] for i in itertools.count())
    callbacks = []
    if checkpoint_dir:
        callbacks = [kt.callbacks.AutoResume(checkpoint_dir), kt.callbacks.ModelSaver(checkpoint_dir)]
    with kt.distributed("mirrored", devices=devices):
        trainer = KMeansTrainer(KMeans(CENTERS + np.array([0.9, -0.8], "float32")), batches)
        history = trainer.train(callbacks, steps_per_epoch=8, max_epoch=epochs, verbose=0)
    return trainer, history.history


def test_kmeans_on_towers_equals_one_device_and_resumes_exactly(tmp_path):
    one, one_logs = _kmeans(ONE, 32, epochs=3)
    two, two_logs = _kmeans(TWO, 16, epochs=3)
    nearest = np.linalg.norm(CENTERS[:, None] - two.model.centroids.numpy()[None], axis=-1).min(axis=1)
    assert nearest.max() < 0.1
    np.testing.assert_allclose(two.model.centroids.numpy(), one.model.centroids.numpy(), atol=1e-5)
    np.testing.assert_array_equal(two.model.counts.numpy(), one.model.counts.numpy())
    np.testing.assert_allclose(two_logs["inertia"], one_logs["inertia"], atol=1e-5)
    _kmeans(TWO, 16, epochs=1, checkpoint_dir=str(tmp_path))
    resumed, resumed_logs = _kmeans(TWO, 16, epochs=3, checkpoint_dir=str(tmp_path))
    assert resumed.global_step == 24 and resumed.loop.tower_batches == [24, 24]
    np.testing.assert_array_equal(resumed.model.centroids.numpy(), two.model.centroids.numpy())
    assert resumed_logs["inertia"] == two_logs["inertia"][1:]


def real_and_noise(batch, with_noise=True):
    rng = np.random.default_rng(0)
    real = rng.normal(2.0, 0.5, (512, 3)).astype("float32")
    noise = rng.normal(0.0, 1.0, (512, 4)).astype("float32")
    for i in itertools.count():
        start = (i * batch) % 512
        yield (real[start:start + batch], noise[start:start + batch]) if with_noise else real[start:start + batch]


@pytest.mark.parametrize("trainer", ["GANTrainer", "SeparateGANTrainer"])
def test_gan_on_two_towers_equals_one_tower_on_the_joined_batches(trainer):
    results = {}
    for devices, batch in ((ONE, 16), (TWO, 8)):
        with kt.distributed("mirrored", devices=devices):
            gan = tiny_gan(NoiseFromInput)
            kwargs = {"g_period": 2} if trainer == "SeparateGANTrainer" else {}
            history = getattr(kt, trainer)(gan, real_and_noise(batch), **kwargs).train(
                steps_per_epoch=5, max_epoch=2, verbose=0)
        results[len(devices)] = ([np.asarray(w.value) for w in gan.generator.weights + gan.discriminator.weights],
                                 history.history, int(gan.g_optimizer.iterations.numpy()))
    (one, one_logs, g_steps), (two, two_logs, _) = results[1], results[2]
    assert g_steps == (10 if trainer == "GANTrainer" else 5)
    assert not np.allclose(one[0], np.asarray(tiny_gan().generator.weights[0].value))   # it trained
    for a, b in zip(one, two):
        np.testing.assert_allclose(b, a, atol=1e-5)
    for key in ("g_loss", "d_loss"):
        np.testing.assert_allclose(two_logs[key], one_logs[key], atol=1e-5)


def test_gan_checkpoint_holds_both_optimizers_and_resumes_exactly(tmp_path):
    def run(epochs, checkpoint_dir=None):
        callbacks = []
        if checkpoint_dir:
            callbacks = [kt.callbacks.AutoResume(checkpoint_dir), kt.callbacks.ModelSaver(checkpoint_dir)]
        with kt.distributed("mirrored", devices=TWO):
            gan = tiny_gan()
            kt.GANTrainer(gan, real_and_noise(8, with_noise=False)).train(
                callbacks, steps_per_epoch=4, max_epoch=epochs, verbose=0)
        return gan

    straight = run(3)
    run(1, str(tmp_path))
    resumed = run(3, str(tmp_path))
    for name in ("variables", "g_optimizer", "d_optimizer"):
        left = straight.variables if name == "variables" else getattr(straight, name).variables
        right = resumed.variables if name == "variables" else getattr(resumed, name).variables
        for a, b in zip(left, right):
            np.testing.assert_array_equal(np.asarray(b.value), np.asarray(a.value), err_msg=a.path)


def test_towers_draw_their_own_noise():
    seen = []

    class Keep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(tuple(np.asarray(logs["noise"]).tolist()))

    with kt.distributed("mirrored", devices=TWO):
        NoiseProbe(tiny_gan(), real_and_noise(4, with_noise=False)).train([Keep()], steps_per_epoch=3, verbose=0)
    assert all(tower0 != tower1 for tower0, tower1 in seen), seen
    assert len(set(seen)) == 3


def test_a_nonfinite_gradient_on_one_tower_stops_with_the_weights_of_the_step_before():
    def batches():
        x = np.ones((4, 3), "float32")
        for i in itertools.count():
            bad = x * np.nan if i == 5 else x   # step 3, tower 1
            yield bad, np.ones((4, 1), "float32")

    keras.utils.set_random_seed(5)
    with kt.distributed("mirrored", devices=TWO):
        model = Linear()   # no synchronized BN: that would spread tower 1's NaN to tower 0
        model.compile(optimizer="adam")
        trainer = RegressionTrainer(model, batches())
        before = []

        class Keep(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                before[:] = [np.asarray(v.value) for v in model.trainable_variables]

        with pytest.raises(kt.NonFiniteError, match=r"step 3.*tower 1 of 2"):
            trainer.train([Keep()], steps_per_epoch=5, verbose=0)
    assert trainer.global_step == 2
    for kept, now in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(np.asarray(now.value), kept)


def test_trainer_errors_on_jax_say_what_to_do():
    with pytest.raises(kt.InputSourceError, match="generator"):
        kt.Trainer(input=np.ones((8, 2)))

    class Unbuilt(kt.GANTrainer):
        def _setup(self):
            pass   # GANTrainer's builds both optimizers here

    with kt.distributed("mirrored", devices=TWO):
        gan = tiny_gan()
    with pytest.raises(kt.KerasTowerError, match=r"not built.*optimizer.build"):
        Unbuilt(gan, real_and_noise(4, with_noise=False)).train(steps_per_epoch=1, verbose=0)

    with kt.distributed("mirrored", devices=TWO):
        model = Regression()
        model.compile(optimizer="sgd")

    class NoVariables(RegressionTrainer):
        @kt.Trainer.tower_function
        def fit_batch(self, batch):
            grads = [keras.ops.zeros(v.shape) for v in self.model.trainable_variables]
            self.model.optimizer.apply(grads)
            return {}

    with pytest.raises(kt.KerasTowerError, match=r"apply\(grads, variables\)"):
        NoVariables(model, _regression_batches(4)).train(steps_per_epoch=1, verbose=0)


class ActivityRegularized(Linear):
    """Linear with an activity regularizer: a loss the layer adds while called."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.penalty = keras.layers.ActivityRegularization(l2=0.1)

    def call(self, x, training=False):
        return self.penalty(self.dense(x))


class PenalizedTrainer(RegressionTrainer):
    @kt.Trainer.tower_function
    def fit_batch(self, batch):
        x, y = batch
        ctx = kt.get_current_tower_context()

        def loss():
            mse = keras.ops.mean(keras.ops.square(self.model(x, training=True) - y))
            self.penalties = len(self.model.losses)   # the activity regularizer's, while traced
            return mse + keras.ops.sum(self.model.losses)

        return {"loss": kt.minimize(self.model.optimizer, loss, self.model.trainable_variables),
                "share": ctx.example_weight}


def test_model_losses_and_the_example_share_inside_a_tower_function():
    results = []
    for devices, per_tower in ((ONE, 8), (TWO, 4)):
        keras.utils.set_random_seed(5)
        with kt.distributed("mirrored", devices=devices):
            model = ActivityRegularized()
            model.compile(optimizer="sgd")
            trainer = PenalizedTrainer(model, _regression_batches(per_tower))
            history = trainer.train(steps_per_epoch=3, verbose=0)
        assert trainer.penalties == 1
        results.append((model.dense.kernel.numpy(), history.history))
    (one, one_logs), (two, two_logs) = results
    assert two_logs["share"] == [0.5] and one_logs["share"] == [1.0]
    np.testing.assert_allclose(two, one, atol=1e-5)
    np.testing.assert_allclose(two_logs["loss"], one_logs["loss"], atol=1e-5)


def test_what_a_jax_tower_function_cannot_do_says_so():
    class OutsideVariable(RegressionTrainer):
        def _setup(self):
            super()._setup()
            self.outside = keras.Variable(0.0)   # not on the model: checkpoints would miss it

        @kt.Trainer.tower_function
        def fit_batch(self, batch):
            self.outside.assign(self.outside + 1.0)
            return {}

    with kt.distributed("mirrored", devices=TWO):
        model = Regression()
        model.compile(optimizer="sgd")
    with pytest.raises(kt.KerasTowerError, match="neither the model nor its optimizers"):
        OutsideVariable(model, _regression_batches(4)).train(steps_per_epoch=1, verbose=0)

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with kt.distributed("mirrored", devices=TWO):
            mixed = Regression()
            mixed.compile(optimizer="sgd")   # Keras wraps it in a LossScaleOptimizer
    finally:
        keras.mixed_precision.set_global_policy("float32")
    with pytest.raises(kt.KerasTowerError, match="LossScaleOptimizer"):
        RegressionTrainer(mixed, _regression_batches(4)).train(steps_per_epoch=1, verbose=0)


def test_check_finite_false_applies_a_nonfinite_step_in_a_tower_function():
    def batches():
        while True:
            yield np.full((4, 3), np.nan, "float32"), np.ones((4, 1), "float32")

    with kt.distributed("mirrored", devices=TWO):
        model = Linear()
        model.compile(optimizer="sgd", check_finite=False)
        RegressionTrainer(model, batches()).train(steps_per_epoch=2, verbose=0)
    assert np.isnan(model.dense.kernel.numpy()).all() and model.optimizer.iterations.numpy() == 2
