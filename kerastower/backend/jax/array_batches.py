"""numpy arrays as per-tower batches on the JAX backend.

Which rows each tower takes is decided for both backends by `ArrayRows`
(array_rows.py): tower k of step s takes batch `s * N + k` of the pass, so
`total batch = batch_size x N`, in the same order as on TensorFlow. What
is JAX's own is the placing: a step's batches form one array sharded over
the towers, so they need one shape. The last step of a pass, when it has
fewer than `batch_size x N` examples, therefore runs as one tower on all
of them: on the joined batch, what N towers with an example-weighted
reduce would compute. A `tf.RaggedTensor` or sparse array among the arrays
gives batches as Keras's JAX adapters give them (ragged rows padded, a
sparse batch a BCOO; ragged_sparse.py says how the towers differ).

Examples:
    >>> from kerastower.backend.jax.array_batches import ArrayBatches
    >>> batches = ArrayBatches(np.arange(10.0)[:, None], np.zeros(10), batch_size=2)
    >>> [[b[0][:, 0].tolist() for b in step] for step in batches.one_pass(num_towers=2)]
    [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], [6.0, 7.0]], [[8.0, 9.0]]]
"""

import itertools

import keras
import numpy as np

from kerastower.errors import InputSourceError
from kerastower.inputs import ragged_sparse
from kerastower.inputs.array_rows import ArrayRows

__all__ = ["ArrayBatches"]


def _rows(array):
    """What a batch's rows are taken from: the array itself, or, for a
    ragged or sparse one, a taker giving batches as Keras makes them on JAX."""
    if ragged_sparse.is_ragged(array):
        return ragged_sparse.RaggedRows(array)
    if ragged_sparse.is_sparse(array):
        return ragged_sparse.SparseRows(array)
    return np.asarray(array)


class ArrayBatches:
    """numpy arrays cut into per-tower batches, reshuffled every pass.

    Elements are laid out as Keras unpacks them: `(x,)`, `(x, y)` or
    `(x, y, sample_weight)`; `x` may be a list or dict of arrays.
    """

    # Reading batches ahead changes nothing: fit places the next step's
    # while one runs.
    read_ahead = True

    def __init__(self, x, y=None, sample_weight=None, batch_size=32, shuffle=False):
        if y is None and sample_weight is not None:
            raise InputSourceError(
                "sample_weight was given without y; kerastower needs targets to "
                "weight. Pass y, or put the weights into the loss yourself."
            )
        # As Keras packs it: x alone without y (a list of inputs as a tuple).
        if y is None and sample_weight is None:
            x = tuple(x) if isinstance(x, list) else x
            self._element = (x,) if isinstance(x, tuple) else x
        else:
            self._element = tuple(a for a in (x, y, sample_weight) if a is not None)
        leaves = keras.tree.flatten(self._element)
        if not leaves or not all(
                ragged_sparse.is_composite(a) or (hasattr(a, "shape") and np.ndim(a) >= 1)
                for a in leaves):
            raise InputSourceError(
                "On the JAX backend, fit, evaluate and predict take numpy arrays (or "
                "lists and dicts of them, tf.RaggedTensors and sparse arrays among "
                "them), a Python generator or iterable of batches, or a "
                "keras.utils.PyDataset; got "
                f"{[type(a).__name__ for a in leaves] or type(x).__name__}."
            )
        lengths = {ragged_sparse.rows_of(a) for a in leaves}
        if len(lengths) != 1:
            raise InputSourceError(
                "x, y and sample_weight must have the same number of examples; "
                f"got lengths {sorted(lengths)}."
            )
        self.length = lengths.pop()
        # Gathered leaf by leaf and packed back as the element is: a step's
        # batches cost the gather, not a walk of the structure each time.
        self._leaves = [_rows(a) for a in leaves]
        # Ragged rows are padded per batch and sparse rows made BCOO batches,
        # as Keras hands them to a JAX model; a step's towers then share a
        # shape (`ragged_sparse.for_towers`).
        self._composite = any(isinstance(a, (ragged_sparse.RaggedRows, ragged_sparse.SparseRows))
                              for a in self._leaves)
        # (x, y[, sample_weight]) of arrays: a tuple of the leaves as they are.
        self._flat = type(self._element) is tuple and all(hasattr(a, "shape") for a in self._element)
        self.batch_size = batch_size
        self.rows = ArrayRows(self.length, batch_size, shuffle)

    @property
    def shuffle_seed(self):
        """The seed of every pass's order (None without shuffle); processes agree on it."""
        return self.rows.seed

    @shuffle_seed.setter
    def shuffle_seed(self, seed):
        self.rows.seed = seed

    def check_finite(self, method, argument=None):
        """Arrays always end: nothing to check."""

    def steps(self, num_towers):
        """Steps in one pass with `num_towers` towers."""
        return self.rows.num_steps(num_towers)

    def first_batch(self):
        """Tower 0's first batch (what the model is built from)."""
        peek = getattr(self.rows.pass_order, "peek", None)
        if peek is not None:  # Keras's fit draws for the batch it builds from
            peek()
        return self._take(np.arange(min(self.batch_size, self.length)))

    def _take_consecutive(self, indices):
        return self._take(slice(int(indices[0]), int(indices[-1]) + 1))

    def _take(self, indices):
        batch = [a[indices] for a in self._leaves]
        if self._flat:
            return tuple(batch)
        return keras.tree.pack_sequence_as(self._element, batch)

    def one_pass(self, num_towers, pass_index=0, skip_steps=0):
        """The steps of pass `pass_index`, from step `skip_steps` on.

        Each is a list of per-tower batches (one batch holding the rest, for
        a last step short of a whole one). A resumed pass replays the same
        order from the seed, less the `skip_steps` steps taken before."""
        # Unshuffled (evaluate, predict, shuffle=False), a batch's rows
        # are consecutive: a slice takes them as a view, where a gather
        # copied them (a 64x784 float32 batch: 50 us a step).
        take = self._take if self.rows.shuffle else self._take_consecutive
        for step in self.rows.steps_of_pass(num_towers, pass_index, skip_steps):
            if len(step) == num_towers and len(step[-1]) == self.batch_size:
                batches = [take(rows) for rows in step]
                yield ragged_sparse.for_towers(batches, num_towers) if self._composite else batches
            else:
                batch = [take(np.concatenate(step))]
                yield ragged_sparse.for_towers(batch, num_towers) if self._composite else batch

    def endless(self, num_towers, first_pass=0, skip_steps=0):
        """Pass after pass, each reshuffled, less the first `skip_steps` steps of all."""
        per_pass = self.steps(num_towers)
        if per_pass == 0:
            return iter(())
        first_pass += skip_steps // per_pass
        skip_steps %= per_pass
        return itertools.chain(
            self.one_pass(num_towers, first_pass, skip_steps),
            itertools.chain.from_iterable(
                self.one_pass(num_towers, p) for p in itertools.count(first_pass + 1)))
