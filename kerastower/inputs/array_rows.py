"""Which rows of in-memory arrays each tower takes, pass by pass: on every backend.

`fit(x, y, batch_size=B)` on N towers reads the arrays in passes. A pass
orders the examples (in place, or shuffled with a seed and the pass's
index, so every pass can be replayed), cuts that order into batches of B
rows, and tower k of step s takes batch s*N+k, whole: nothing is split, and
a pass's last batch may be short. `ArrayRows` decides all of that and
imports neither TensorFlow nor JAX; each engine only gathers the rows and
places them: TensorFlow in a tf.data pipeline (`backend/tensorflow/array_input.py`), JAX on
the towers' devices (`backend/jax/array_batches.py`). Both backends therefore read
the same examples in the same order for a given seed.

Examples:
    >>> from kerastower.inputs.array_rows import ArrayRows
    >>> rows = ArrayRows(length=10, batch_size=2)
    >>> [[r.tolist() for r in step] for step in rows.steps_of_pass(num_towers=2)]
    [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9]]]
    >>> rows.num_steps(num_towers=2), rows.num_batches()
    (3, 5)
"""

import numpy as np

__all__ = ["ArrayRows"]


class ArrayRows:
    """The pass orders of `length` examples and the rows of each tower's batch.

    Args:
        length: the number of examples (rows) in the arrays.
        batch_size: rows in one tower's batch.
        shuffle: True reorders the examples every pass; "batch" too (it
            reorders only within batches where Keras's order is followed,
            see `pass_order`).
        seed: the shuffle's seed; None draws one, when first needed, from
            numpy's global generator (which `keras.utils.set_random_seed`
            seeds), so a seeded run is replayable. Processes that read the
            same arrays must agree on it (`seed` can be set, e.g. to the
            chief's).

    Attributes:
        pass_order: None, or a function of a pass's index giving its order,
            which then replaces the seeded one: the engine sets Keras's own
            order there (that of stock `fit` with the same seed), where
            `keras.utils.set_random_seed` was called (the chief's, over
            several processes).
    """

    def __init__(self, length, batch_size, shuffle=False, seed=None):
        self.length = int(length)
        self.batch_size = int(batch_size)
        self.shuffle = "batch" if isinstance(shuffle, str) and shuffle == "batch" else bool(shuffle)
        self._seed = seed
        self.pass_order = None

    @property
    def seed(self):
        """The seed of the passes' orders (drawn when first read; None
        without shuffle or where `pass_order` decides)."""
        if self._seed is None and self.shuffle and self.pass_order is None:
            self._seed = int(np.random.randint(2**31 - 1))
        return self._seed

    @seed.setter
    def seed(self, seed):
        self._seed = seed

    def fix_seed(self):
        """Draws the seed now, where no `pass_order` decides: numpy's
        generator is then read when fit makes its source, on both backends,
        whatever reads it before the first pass."""
        return self.seed

    def order(self, pass_index):
        """The example indices (int64) in the order pass `pass_index` reads them."""
        if not self.shuffle:
            return np.arange(self.length, dtype=np.int64)
        if self.pass_order is not None:
            return np.asarray(self.pass_order(int(pass_index)), dtype=np.int64)
        rng = np.random.default_rng([int(self.seed), int(pass_index)])
        return rng.permutation(self.length).astype(np.int64)

    def num_batches(self):
        """Batches in one pass (its last one may be short)."""
        return -(-self.length // self.batch_size)

    def num_steps(self, num_towers):
        """Steps in one pass with `num_towers` towers (the last may be short)."""
        return -(-self.num_batches() // num_towers)

    def batches_of_pass(self, pass_index=0, skip_batches=0):
        """The row indices of pass `pass_index`'s batches, from batch `skip_batches` on."""
        order = self.order(pass_index)
        size = self.batch_size
        return [order[start:start + size] for start in range(skip_batches * size, self.length, size)]

    def steps_of_pass(self, num_towers, pass_index=0, skip_steps=0):
        """Pass `pass_index`'s steps from step `skip_steps` on: each a list of
        the row indices of tower 0's, 1's, ... batch (batch s*N+k); a pass's
        last step lists only the batches the pass has left."""
        batches = self.batches_of_pass(pass_index, skip_steps * num_towers)
        for start in range(0, len(batches), num_towers):
            yield batches[start:start + num_towers]
