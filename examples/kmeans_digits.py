"""Cluster scikit-learn's digits with data-parallel mini-batch k-means.

    python examples/kmeans_digits.py [--epochs 5] [--steps 40] [--towers 2] [--ckpt DIR]

Training without gradients, run by `kt.Trainer`: each tower assigns its own
batch of points to their nearest centroids and sums them per centroid; the
sums are added over towers and every centroid moves to the running mean of
all the points it has taken (Sculley's mini-batch k-means). Callbacks,
checkpoints and auto-resume work as under `fit`: kill it and run it again
with the same --ckpt, and it goes on from the last epoch it saved.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from example_devices import tower_devices  # noqa: E402

import kerastower as kt  # noqa: E402


class KMeans(kt.TowerModel):
    """k centroids; calling it gives each point's nearest centroid.

    Args:
        initial_centroids: a (k, dim) array to start from.
    """

    def __init__(self, initial_centroids, **kwargs):
        super().__init__(**kwargs)
        initial_centroids = np.asarray(initial_centroids, "float32")
        self.centroids = self.add_weight(
            shape=initial_centroids.shape,
            initializer=keras.initializers.Constant(initial_centroids),
            trainable=False,
            name="centroids",
        )
        self.counts = self.add_weight(
            shape=initial_centroids.shape[:1], initializer="zeros", trainable=False, name="counts"
        )

    def squared_distances(self, points):
        """(n, k): from every point to every centroid."""
        centroids = tf.convert_to_tensor(self.centroids)
        return (
            tf.reduce_sum(points**2, axis=1, keepdims=True)
            - 2.0 * tf.matmul(points, centroids, transpose_b=True)
            + tf.reduce_sum(centroids**2, axis=1)[None, :]
        )

    def call(self, points):
        return tf.argmin(self.squared_distances(points), axis=1)


class MiniBatchKMeansTrainer(kt.Trainer):
    """One iteration: every tower assigns its batch, then the centroids move.

    Logs `inertia`: the mean squared distance of the step's points to their
    nearest centroid, before the move.
    """

    def run_step(self):
        sums = self.hooked_run(self.assign_points, self.next_batches())
        counts = tf.cast(sums["counts"], "float32")
        total = self.model.counts + counts
        centroids = tf.convert_to_tensor(self.model.centroids)
        moved = centroids + (tf.cast(sums["sums"], "float32") - counts[:, None] * centroids) / tf.maximum(
            total, 1.0
        )[:, None]
        self.model.centroids.assign(moved)
        self.model.counts.assign(total)
        return {"inertia": sums["inertia"] / sums["points"]}

    @kt.Trainer.tower_function(reduce="sum", training=False)
    def assign_points(self, points):
        distances = self.model.squared_distances(points)
        nearest = tf.one_hot(tf.argmin(distances, axis=1), tf.shape(distances)[1])
        return {
            "sums": tf.matmul(nearest, points, transpose_a=True),
            "counts": tf.reduce_sum(nearest, axis=0),
            "inertia": tf.reduce_sum(tf.reduce_min(distances, axis=1)),
            "points": tf.cast(tf.shape(points)[0], "float32"),
        }


def purity(assignments, labels, k):
    """The share of points whose cluster's most common digit is theirs."""
    agree = 0
    for cluster in range(k):
        members = labels[assignments == cluster]
        if len(members):
            agree += np.bincount(members).max()
    return agree / len(labels)


def main():
    from sklearn.datasets import load_digits

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="iterations per epoch")
    parser.add_argument("--batch", type=int, default=64, help="points per tower")
    parser.add_argument("--towers", type=int, default=2)
    parser.add_argument("--ckpt", default=None, help="checkpoint directory (auto-resume)")
    args = parser.parse_args()

    devices = tower_devices(args.towers, gpu_towers=args.towers)
    digits = load_digits()
    points = (digits.data / 16.0).astype("float32")
    rng = np.random.default_rng(0)
    initial = points[rng.choice(len(points), 10, replace=False)]
    data = tf.data.Dataset.from_tensor_slices(points).shuffle(len(points), seed=0)
    data = data.repeat().batch(args.batch, drop_remainder=True)

    callbacks = [kt.callbacks.ScalarPrinter()]
    if args.ckpt:
        callbacks = [kt.callbacks.AutoResume(args.ckpt), kt.callbacks.ModelSaver(args.ckpt)] + callbacks
    with kt.distributed("mirrored", devices=devices):
        model = KMeans(initial)
        trainer = MiniBatchKMeansTrainer(model, kt.DatasetInput(data))
        trainer.train(callbacks, steps_per_epoch=args.steps, max_epoch=args.epochs, verbose=0)
    assignments = model.predict(points, batch_size=256, verbose=0)
    print(f"cluster purity: {purity(assignments, digits.target, 10):.3f}")


if __name__ == "__main__":
    main()
