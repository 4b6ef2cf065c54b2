"""Train a small ConvNet on scikit-learn's digits with one tower per device.

    python examples/train_digits.py [--epochs 8] [--batch 32] [--logdir logs/digits]

With GPUs, one tower runs on each GPU; without, the CPU is split into two
logical devices so that the two-tower path runs anywhere. Each tower takes
its own batch of --batch images: total batch = --batch x towers.
TensorBoard logs and stats.json are left in --logdir
(`tensorboard --logdir logs/digits`).
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from example_devices import tower_devices  # noqa: E402


def load_digits():
    """8x8 grey images in [0, 1], split 80/20; shipped with scikit-learn."""
    import numpy as np
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    images = (digits.images / 16.0).astype("float32")[..., None]
    labels = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(labels))
    images, labels = images[order], labels[order]
    split = int(0.8 * len(labels))
    return (images[:split], labels[:split]), (images[split:], labels[split:])


def build_model():
    import keras

    import kerastower as kt

    inputs = keras.Input((8, 8, 1))
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.BatchNormalization(momentum=0.9)(h)
    h = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dropout(0.25)(h)
    outputs = keras.layers.Dense(10)(h)
    return kt.TowerModel(inputs, outputs, name="digits_convnet")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32, help="per-tower batch size")
    parser.add_argument("--cpu-towers", type=int, default=2)
    parser.add_argument("--logdir", default=os.path.join("logs", "digits"))
    args = parser.parse_args()

    devices = tower_devices(args.cpu_towers)

    import keras

    import kerastower as kt

    keras.utils.set_random_seed(0)
    (x_train, y_train), (x_test, y_test) = load_digits()

    @kt.distributed("mirrored", devices=devices)
    def train():
        model = build_model()
        model.compile(
            optimizer=keras.optimizers.Adam(2e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        model.fit(
            x_train,
            y_train,
            batch_size=args.batch,
            epochs=args.epochs,
            validation_data=(x_test, y_test),
            logdir=args.logdir,  # TensorBoard scalars and stats.json
            verbose=2,
        )
        return model.evaluate(x_test, y_test, batch_size=args.batch, verbose=0, return_dict=True)

    result = train()
    print(f"final test accuracy: {result['accuracy']:.4f} (loss {result['loss']:.4f})")
    print(f"TensorBoard logs: {args.logdir}")


if __name__ == "__main__":
    main()
