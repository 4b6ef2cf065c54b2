"""The order stock Keras's `fit` reads arrays in, followed where it is known.

`keras.utils.set_random_seed(s)` makes stock Keras's `fit(x, y)` read the
arrays in an order fixed by the seed: on TensorFlow, its array adapter
shuffles the row indices with `tf.random.shuffle` inside its tf.data
pipeline (`shuffle=True`: the whole pass; `"batch"`: within each batch).
A user who switches to kerastower with the same seed must get the same
numbers on one tower, so where one process reads the arrays and that seed
was set, each pass's order is the one Keras's own pipeline gives, read
from that pipeline (the indices are its only input). N towers read the
order Keras gives one device with their joined batch (the per-tower
batch x N), so they equal one device on the joined batches.

Elsewhere (no seed, or several processes, which must agree on an order
the chief draws) the passes follow `ArrayRows`'s own seeded order.

Measured with Keras 3.15 on TensorFlow 2.21: with the seed set, stock
Keras's pipeline gives every epoch the same order (a new iterator of one
pipeline per epoch replays its seeded shuffle); this module gives the same.

    >>> import keras, numpy as np
    >>> from kerastower.inputs.keras_order import KerasPassOrder
    >>> keras.utils.set_random_seed(0)
    >>> order = KerasPassOrder(length=10, joined_batch=4, shuffle=True)
    >>> sorted(order(0).tolist()) == list(range(10))
    True
"""

import threading

import numpy as np

from kerastower import _compat

__all__ = ["KerasPassOrder", "follow_keras"]


class KerasPassOrder:
    """Pass p's order: the rows Keras's own array pipeline reads in its
    p-th iteration (one iteration per epoch, as Keras's fit makes), for
    `length` examples in batches of `joined_batch`."""

    def __init__(self, length, joined_batch, shuffle):
        self.key = (int(length), int(joined_batch), shuffle)
        self._batches = _compat.keras_array_batches(int(length), int(joined_batch), shuffle)
        self._read = -1       # the last pass read from the pipeline
        self._kept = {}       # the last two passes' orders
        # The towers' pipelines ask for orders from tf.data's threads.
        self._lock = threading.Lock()

    def __call__(self, pass_index):
        with self._lock:
            if pass_index not in self._kept:
                if pass_index < self._read:  # an earlier pass: replay from the first
                    self._read = -1
                while self._read < pass_index:
                    order = np.concatenate([np.asarray(batch) for batch in self._batches])
                    self._read += 1
                    self._kept = {k: v for k, v in self._kept.items() if k == self._read - 1}
                    self._kept[self._read] = order
            return self._kept[pass_index]


def follow_keras(rows, strategy):
    """Sets `rows.pass_order` to Keras's order (see the module docstring)
    where one process reads the arrays and Keras's seed is set, else to None."""
    if not strategy.single_process or _compat.keras_random_seed() is None:
        rows.pass_order = None
        return
    key = (rows.length, rows.batch_size * strategy.num_towers, rows.shuffle)
    if getattr(rows.pass_order, "key", None) != key:
        rows.pass_order = KerasPassOrder(*key)
