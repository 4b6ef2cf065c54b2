"""GAN trainers: data-parallel exactly, training on the digits images, step
periods, checkpoints holding both optimizers, and the example script."""

import json
import math
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

import kerastower as kt
from tests.tensorflow.helpers import TWO

from tests.helpers.common import ROOT
from tests.helpers.examples import import_example
from tests.helpers.loop_cases import NoiseFromInput
from tests.helpers.loop_cases import NoiseProbe
from tests.helpers.loop_cases import tiny_gan

gan_digits = import_example("gan_digits")


def real_and_noise(batch):
    rng = np.random.default_rng(0)
    real = rng.normal(2.0, 0.5, (512, 3)).astype("float32")
    noise = rng.normal(0.0, 1.0, (512, 4)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((real, noise)).repeat().batch(batch)


def test_two_towers_equal_one_tower_on_the_joined_batches():
    weights = {}
    for devices, batch in ((TWO[:1], 16), (TWO, 8)):
        with kt.distributed("mirrored", devices=devices):
            gan = tiny_gan(NoiseFromInput)
            trainer = kt.GANTrainer(gan, kt.DatasetInput(real_and_noise(batch)))
            history = trainer.train(steps_per_epoch=5, max_epoch=2, verbose=0)
        weights[len(devices)] = ([w.numpy() for w in gan.generator.weights + gan.discriminator.weights], history.history)
        assert int(gan.g_optimizer.iterations.numpy()) == int(gan.d_optimizer.iterations.numpy()) == 10
    (one, one_logs), (two, two_logs) = weights[1], weights[2]
    assert not np.allclose(one[0], tiny_gan().generator.weights[0].numpy())  # it trained
    for a, b in zip(one, two):
        np.testing.assert_allclose(b, a, atol=1e-5)
    for key in ("g_loss", "d_loss"):
        np.testing.assert_allclose(two_logs[key], one_logs[key], atol=1e-5)


# On 1 tower; test_gan_digits_example_runs trains the example on 2 towers
# and checks that it learns the digits there.
@pytest.mark.parametrize("towers", [1])
def test_gan_learns_the_digits(towers):
    images, labels = gan_digits.load_images()
    real = tf.data.Dataset.from_tensor_slices(images).shuffle(len(images), seed=0)
    real = real.repeat().batch(64 // towers, drop_remainder=True)
    with kt.distributed("mirrored", devices=TWO[:towers]):
        keras.utils.set_random_seed(0)
        gan = gan_digits.build_gan()
        confident_before, _ = gan_digits.judge(gan.generate(1000), images, labels)
        first_step = {}
        keep_first = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: first_step.setdefault("logs", dict(logs)))
        history = kt.GANTrainer(gan, kt.DatasetInput(real)).train(
            [keep_first], steps_per_epoch=200, max_epoch=4, verbose=0
        )
    confident_after, digits = gan_digits.judge(gan.generate(1000), images, labels)
    d_loss, g_loss = history.history["d_loss"], history.history["g_loss"]
    # At the start neither side knows anything: d_loss = 2 log 2, g_loss = log 2.
    assert first_step["logs"]["d_loss"] == pytest.approx(2 * math.log(2), abs=0.15)
    assert first_step["logs"]["g_loss"] == pytest.approx(math.log(2), abs=0.15)
    # The discriminator learns to tell them apart (d_loss falls, g_loss rises)
    # and the generator keeps up: neither side wins outright.
    assert all(0.6 < d < 2 * math.log(2) - 0.2 for d in d_loss), d_loss
    assert all(math.log(2) + 0.3 < g < 3.0 for g in g_loss), g_loss
    assert confident_before < 0.05 and confident_after > 0.25, (confident_before, confident_after)
    assert digits >= 7, digits


def test_separate_gan_trainer_runs_each_side_on_its_period(two_towers):
    runs = []

    class Runs(kt.callbacks.Callback):
        def _after_run(self, outputs):
            runs.append((self.global_step, sorted(outputs)))

    gan = tiny_gan()
    real = tf.data.Dataset.from_tensor_slices(np.ones((64, 3), "float32")).repeat().batch(4)
    trainer = kt.SeparateGANTrainer(gan, kt.DatasetInput(real), d_period=3, g_period=2)
    history = trainer.train([Runs()], steps_per_epoch=13, verbose=0)
    assert int(gan.d_optimizer.iterations.numpy()) == math.ceil(13 / 3) == 5
    assert int(gan.g_optimizer.iterations.numpy()) == math.ceil(13 / 2) == 7
    expected = []
    for step in range(13):
        if step % 3 == 0:
            expected.append((step, ["d_loss"]))
        if step % 2 == 0:
            expected.append((step, ["g_loss"]))
    assert runs == expected
    assert trainer.loop.tower_batches == [13, 13]
    assert trainer.loop.examples_seen == 13 * 2 * 4  # batches taken, not runs made
    assert set(history.history) == {"d_loss", "g_loss"}


def test_gan_checkpoint_holds_both_optimizers_and_resumes_exactly(tmp_path, two_towers):
    def run(epochs, checkpoint_dir=None):
        gan = tiny_gan()
        callbacks = []
        if checkpoint_dir:
            callbacks = [kt.callbacks.AutoResume(checkpoint_dir), kt.callbacks.ModelSaver(checkpoint_dir)]
        real = real_and_noise(8).map(lambda r, n: r)
        kt.GANTrainer(gan, kt.DatasetInput(real)).train(callbacks, steps_per_epoch=4, max_epoch=epochs, verbose=0)
        return gan

    straight = run(3)
    run(1, str(tmp_path))
    resumed = run(3, str(tmp_path))
    for a, b in zip(straight.variables, resumed.variables):
        np.testing.assert_array_equal(b.numpy(), a.numpy(), err_msg=a.path)
    for name in ("g_optimizer", "d_optimizer"):
        for a, b in zip(getattr(straight, name).variables, getattr(resumed, name).variables):
            np.testing.assert_array_equal(b.numpy(), a.numpy(), err_msg=a.path)


def test_towers_draw_their_own_noise_also_after_generate(two_towers):
    real = tf.data.Dataset.from_tensor_slices(np.ones((64, 3), "float32")).repeat().batch(4)
    seen = []

    class Keep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(np.asarray(logs["noise"]).tolist())

    NoiseProbe(tiny_gan(), real).train([Keep()], steps_per_epoch=3, verbose=0)
    assert all(tower0 != tower1 for tower0, tower1 in seen), seen
    assert len({tuple(s) for s in seen}) == 3


def test_each_sides_learning_rate_can_be_scheduled(two_towers):
    gan = tiny_gan()
    seen = []
    schedule = kt.callbacks.ScheduledHyperParamSetter("g_optimizer.learning_rate", [(1, 0.02), (2, 0.005)])
    probe = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(
        (float(gan.g_optimizer.learning_rate.numpy()), float(gan.d_optimizer.learning_rate.numpy()))))
    real = tf.data.Dataset.from_tensor_slices(np.ones((64, 3), "float32")).repeat().batch(4)
    kt.GANTrainer(gan, real).train([schedule, probe], steps_per_epoch=2, max_epoch=3, verbose=0)
    np.testing.assert_allclose(seen, [(0.02, 0.1), (0.005, 0.1), (0.005, 0.1)], rtol=1e-6)
    typo = kt.callbacks.ScheduledHyperParamSetter("g_optimizer.learning_rat", [(1, 0.1)])
    typo.set_model(gan)
    with pytest.raises(ValueError, match="No hyper-parameter named 'learning_rat' on g_optimizer"):
        typo.variable


def test_gan_errors_say_what_to_do():
    gan = tiny_gan()
    with pytest.raises(TypeError, match="kt.GANModel"):
        kt.GANTrainer(kt.TowerModel(), tf.data.Dataset.range(3))
    with pytest.raises(ValueError, match="d_period must be a positive int"):
        kt.SeparateGANTrainer(gan, tf.data.Dataset.range(3), d_period=0)
    uncompiled = kt.GANModel(gan.generator, gan.discriminator)
    with pytest.raises(ValueError, match=r"call gan.compile\(g_optimizer"):
        kt.GANTrainer(uncompiled, tf.data.Dataset.range(3)).train(steps_per_epoch=1, verbose=0)
    with pytest.raises(ValueError, match="new optimizer instance"):
        optimizer = keras.optimizers.Adam()
        gan.compile(g_optimizer=optimizer, d_optimizer=optimizer)
    with pytest.raises(ValueError, match="pass latent_dim"):
        kt.GANModel(keras.layers.Dense(3), gan.discriminator)


def test_gan_digits_example_runs(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "gan_digits.py"), "--logdir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "towers: 2, iterations: 1500" in out, out
    confident = float(re.search(r"confident samples after: ([0-9.]+) \((\d+) digits", out).group(1))
    digits = int(re.search(r"confident samples after: [0-9.]+ \((\d+) digits", out).group(1))
    assert confident > 0.3 and digits >= 9, out
    with open(tmp_path / "stats.json") as f:
        records = json.load(f)
    assert [r["global_step"] for r in records] == [250 * e for e in range(1, 7)]
    accumulator = event_accumulator.EventAccumulator(str(tmp_path / "train"))
    accumulator.Reload()
    tags = accumulator.Tags()["tensors"]
    assert {"epoch_d_loss", "epoch_g_loss", "batch_d_loss"} <= set(tags), tags
    d_losses = [float(tf.make_ndarray(e.tensor_proto)) for e in accumulator.Tensors("epoch_d_loss")]
    np.testing.assert_allclose(d_losses, [r["d_loss"] for r in records], rtol=1e-5)
