"""Train a GAN on scikit-learn's digits, one tower per device.

    python examples/gan_digits.py [--epochs 6] [--steps 250] [--towers 2] [--logdir logs/gan]

The generator maps 32 numbers of noise to an 8x8 image; the discriminator
tells real digits from generated ones. `kt.GANTrainer` runs one generator
step then one discriminator step per iteration; each tower takes its own
--batch real images (total batch = --batch x towers). At the end a digit
classifier trained on the real images (scikit-learn) judges 1000 samples:
how many it reads with confidence, and how many of the 10 digits appear.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from example_devices import tower_devices  # noqa: E402

LATENT_DIM = 32


def load_images():
    """The 1797 digits as 64 pixels in [-1, 1], and their labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.data / 8.0 - 1.0).astype("float32"), digits.target


def build_gan():
    import keras

    import kerastower as kt

    generator = keras.Sequential(
        [
            keras.Input((LATENT_DIM,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="tanh"),
        ],
        name="generator",
    )
    discriminator = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128),
            keras.layers.LeakyReLU(0.2),
            keras.layers.Dense(128),
            keras.layers.LeakyReLU(0.2),
            keras.layers.Dense(1),
        ],
        name="discriminator",
    )
    gan = kt.GANModel(generator, discriminator, seed=0)
    gan.compile(
        g_optimizer=keras.optimizers.Adam(1e-3, beta_1=0.5),
        d_optimizer=keras.optimizers.Adam(1e-3, beta_1=0.5),
    )
    return gan


def judge(samples, images, labels):
    """(share of samples a real-digit classifier reads with >= 0.9
    confidence, how many distinct digits those are)."""
    from sklearn.linear_model import LogisticRegression

    classifier = LogisticRegression(max_iter=2000).fit(images, labels)
    probabilities = classifier.predict_proba(samples)
    confident = probabilities.max(axis=1) >= 0.9
    return float(confident.mean()), len(set(probabilities.argmax(axis=1)[confident]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=250, help="iterations per epoch")
    parser.add_argument("--batch", type=int, default=64, help="real images per tower")
    parser.add_argument("--towers", type=int, default=2)
    parser.add_argument("--logdir", default=None)
    args = parser.parse_args()

    devices = tower_devices(args.towers, gpu_towers=args.towers)
    import keras

    import kerastower as kt

    keras.utils.set_random_seed(0)
    images, labels = load_images()
    real = tf.data.Dataset.from_tensor_slices(images).shuffle(len(images), seed=0)
    real = real.repeat().batch(args.batch, drop_remainder=True)

    with kt.distributed("mirrored", devices=devices):
        gan = build_gan()
        before = judge(gan.generate(1000), images, labels)
        trainer = kt.GANTrainer(gan, kt.DatasetInput(real))
        history = trainer.train(
            callbacks=[kt.callbacks.ScalarPrinter()],
            steps_per_epoch=args.steps,
            max_epoch=args.epochs,
            verbose=0,
            logdir=args.logdir,
        )
    after = judge(gan.generate(1000), images, labels)
    print(f"towers: {trainer.num_towers}, iterations: {trainer.global_step}")
    print(f"d_loss by epoch: {np.round(history.history['d_loss'], 3).tolist()}")
    print(f"g_loss by epoch: {np.round(history.history['g_loss'], 3).tolist()}")
    print(f"confident samples before: {before[0]:.3f} ({before[1]} digits)")
    print(f"confident samples after: {after[0]:.3f} ({after[1]} digits)")


if __name__ == "__main__":
    main()
