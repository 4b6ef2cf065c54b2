"""Ragged and sparse inputs, taken as stock Keras's data adapters take them.

On TensorFlow a `tf.RaggedTensor` or `tf.SparseTensor` reaches the model as
it is (`arrays.py` gathers its rows); a scipy sparse matrix or a JAX BCOO
becomes a `tf.SparseTensor` first (`as_tf_sparse`), as Keras makes it.

On JAX, Keras makes a batch's ragged rows dense (`to_tensor()`, padded with
zeros to the batch's longest row) and a batch of a sparse matrix a
`jax.experimental.sparse.BCOO`. kerastower does the same, but for what the
towers need, none of which changes a number:

- the towers of one step pad their ragged rows to the longest row of the
  step's batches, as one device pads the joined batch (`fit_together`):
  the step's batches form one array sharded over the towers;
- a sparse batch is a BCOO with one batch dimension, each row holding the
  same number of entries (padded with entries out of bounds, of value 0):
  for arrays, the largest row's of all the data, so that every batch has
  one shape (one compiled step);
- with several towers, sparse batches are made dense (`for_towers`): JAX's
  sparse operations do not type their results as varying over
  `shard_map`'s towers, so a tower cannot take their gradients.

This module imports TensorFlow or JAX only to handle their own values.

Examples:
    >>> from kerastower.inputs import ragged_sparse
    >>> ragged_sparse.is_composite(np.ones((2, 3)))
    False
"""

import sys

import keras
import numpy as np

from kerastower.errors import DataMismatchError
from kerastower.errors import InputSourceError
from kerastower.errors import KerasTowerError

__all__ = ["is_ragged", "is_sparse", "is_composite", "rows_of", "as_tf_sparse", "PaddedRows",
           "RaggedRows", "SparseRows", "padded", "for_jax", "fit_together", "for_towers", "dense",
           "has_composite", "describe_mismatch", "sparse_predictions_refused"]


def _module(value):
    return type(value).__module__ or ""


def is_ragged(value):
    """Whether `value` is a `tf.RaggedTensor`."""
    if "tensorflow" not in sys.modules:
        return False
    import tensorflow as tf

    return isinstance(value, tf.RaggedTensor)


def _is_tf_sparse(value):
    if "tensorflow" not in sys.modules:
        return False
    import tensorflow as tf

    return isinstance(value, tf.SparseTensor)


def _is_scipy_sparse(value):
    return _module(value).startswith("scipy.sparse") and hasattr(value, "tocoo")


def _is_jax_sparse(value):
    return _module(value).startswith("jax.experimental.sparse")


def is_sparse(value):
    """Whether `value` is a `tf.SparseTensor`, a scipy sparse matrix or a
    JAX sparse array (BCOO)."""
    return _is_tf_sparse(value) or _is_scipy_sparse(value) or _is_jax_sparse(value)


def is_composite(value):
    """Whether `value` is ragged or sparse (`is_ragged`, `is_sparse`)."""
    return not isinstance(value, np.ndarray) and (is_ragged(value) or is_sparse(value))


def has_composite(structure):
    """Whether any leaf of `structure` is ragged, sparse or padded rows."""
    return any(isinstance(leaf, PaddedRows) or is_composite(leaf)
               for leaf in keras.tree.flatten(structure))


def rows_of(value):
    """The number of rows (examples) of an array, ragged or sparse."""
    if is_ragged(value):
        return int(value.nrows())
    if _is_tf_sparse(value):
        return int(value.dense_shape[0])
    return int(value.shape[0]) if hasattr(value, "shape") else int(np.shape(value)[0])


def _floatx(dtype):
    """Keras's own cast of array inputs: floats become floatx."""
    dtype = np.dtype(dtype)
    return np.dtype(keras.config.floatx()) if dtype.kind == "f" else dtype


# -- TensorFlow ---------------------------------------------------------------


def as_tf_sparse(value):
    """A scipy sparse matrix or a JAX BCOO as the `tf.SparseTensor` Keras
    makes of it on TensorFlow (floats as floatx); anything else unchanged."""
    if not (_is_scipy_sparse(value) or _is_jax_sparse(value)):
        return value
    import tensorflow as tf

    coo = _Coo.of(value)
    return tf.sparse.reorder(tf.SparseTensor(coo.indices, coo.values.astype(_floatx(coo.values.dtype)),
                                             coo.shape))


# -- JAX ----------------------------------------------------------------------


class PaddedRows(np.ndarray):
    """A batch of ragged rows made dense (padded with zeros): a numpy array
    that the towers of a step may pad further, to their longest row."""


class _Coo:
    """A sparse array's entries on the host, sorted by row: `indices`
    (entries x rank, int64), `values`, `shape`, and `splits` (row r's
    entries are `splits[r]:splits[r + 1]`)."""

    def __init__(self, indices, values, shape):
        shape = tuple(int(d) for d in shape)
        indices = np.asarray(indices, np.int64).reshape(-1, len(shape))
        values = np.asarray(values)
        # A BCOO pads with entries out of bounds: they hold nothing.
        inside = np.all(indices < np.asarray(shape, np.int64), axis=1) if len(indices) else np.ones(0, bool)
        indices, values = indices[inside], values[inside]
        order = np.argsort(indices[:, 0], kind="stable")
        self.indices, self.values, self.shape = indices[order], values[order], shape
        self.splits = np.concatenate(
            [[0], np.cumsum(np.bincount(self.indices[:, 0], minlength=shape[0]))]).astype(np.int64)

    @classmethod
    def of(cls, value):
        if _is_tf_sparse(value):
            return cls(value.indices.numpy(), value.values.numpy(), value.dense_shape.numpy())
        if _is_scipy_sparse(value):
            coo = value.tocoo()
            return cls(np.stack([coo.row, coo.col], axis=1), coo.data, coo.shape)
        if _is_jax_sparse(value):
            from jax.experimental import sparse as jax_sparse

            if not isinstance(value, jax_sparse.BCOO):
                value = value.to_bcoo() if hasattr(value, "to_bcoo") else jax_sparse.BCOO.fromdense(value.todense())
            if value.n_batch or value.n_dense:
                value = jax_sparse.bcoo_update_layout(value, n_batch=0, n_dense=0)
            return cls(np.asarray(value.indices), np.asarray(value.data), value.shape)
        raise InputSourceError(f"A {type(value).__name__} is not a sparse array.")

    def row_counts(self):
        return np.diff(self.splits)


def _bcoo(data, indices, shape):
    from jax.experimental import sparse as jax_sparse

    return jax_sparse.BCOO((data, indices), shape=tuple(shape))


class SparseRows:
    """A whole sparse array whose rows are taken as BCOO batches: one batch
    dimension, as many entries a row as its largest row holds. `cast`:
    floats become floatx, as Keras casts arrays (not a generator's batches)."""

    def __init__(self, value, cast=True):
        self._coo = _Coo.of(value)
        self.shape = self._coo.shape
        dtype = self._coo.values.dtype
        self.dtype = _floatx(dtype) if cast else dtype
        counts = self._coo.row_counts()
        # At least one entry a row: a batch of empty rows keeps its shape.
        self.width = max(1, int(counts.max()) if counts.size else 0)

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, rows):
        if isinstance(rows, slice):
            rows = np.arange(*rows.indices(self.shape[0]))
        rows = np.asarray(rows, np.int64)
        coo = self._coo
        counts = coo.splits[rows + 1] - coo.splits[rows]
        total = int(counts.sum())
        batch_row = np.repeat(np.arange(len(rows)), counts)
        slot = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        source = np.repeat(coo.splits[rows], counts) + slot
        data = np.zeros((len(rows), self.width), self.dtype)
        # Padding entries point past the end of every dimension.
        indices = np.broadcast_to(np.asarray(self.shape[1:], np.int32),
                                  (len(rows), self.width, len(self.shape) - 1)).copy()
        data[batch_row, slot] = coo.values[source]
        indices[batch_row, slot] = coo.indices[source, 1:]
        return _bcoo(data, indices, (len(rows),) + self.shape[1:])


class RaggedRows:
    """A whole `tf.RaggedTensor` whose rows are taken as dense batches
    (`PaddedRows`), padded as Keras pads them on JAX."""

    def __init__(self, value):
        import tensorflow as tf

        dtype = np.dtype(value.dtype.as_numpy_dtype)
        if _floatx(dtype) != dtype:
            value = tf.cast(value, _floatx(dtype))
        self._value = value
        self.shape = (rows_of(value),)

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, rows):
        import tensorflow as tf

        batch = self._value[rows] if isinstance(rows, slice) else tf.gather(self._value, rows)
        return padded(batch)


def padded(ragged):
    """A `tf.RaggedTensor` batch made dense as Keras makes it on JAX."""
    return np.asarray(ragged.to_tensor()).view(PaddedRows)


def for_jax(leaf):
    """A ragged or sparse leaf of a Python source's batch as Keras hands it
    to a JAX model: ragged rows padded (`PaddedRows`), a sparse array as a
    BCOO with one batch dimension."""
    if is_ragged(leaf):
        return padded(leaf)
    rows = SparseRows(leaf, cast=False)
    return rows[np.arange(len(rows))]


def _is_bcoo_rows(leaf):
    return _is_jax_sparse(leaf) and getattr(leaf, "n_batch", 0) == 1


def _padded_to(array, shape):
    return np.pad(np.asarray(array).view(np.ndarray),
                  [(0, 0)] + [(0, want - have) for have, want in zip(array.shape[1:], shape)])


def dense(bcoo):
    """A BCOO of one batch dimension as a dense numpy array (made on the
    host: its padding entries, out of bounds, are dropped)."""
    data, indices = np.asarray(bcoo.data), np.asarray(bcoo.indices)
    array = np.zeros(bcoo.shape, data.dtype)
    rows = np.broadcast_to(np.arange(data.shape[0])[:, None], data.shape)
    inside = np.all(indices < np.asarray(bcoo.shape[1:]), axis=-1)
    coordinates = (rows[inside],) + tuple(indices[inside].T)
    np.add.at(array, coordinates, data[inside])
    return array


def for_towers(batches, num_towers):
    """The towers' batches of one step as the step takes them
    (`fit_together`); where the run has several towers (`num_towers`),
    sparse batches made dense (see the module)."""
    if num_towers > 1:
        batches = [keras.tree.map_structure(lambda a: dense(a) if _is_bcoo_rows(a) else a, b)
                   for b in batches]
    return fit_together(batches)


def fit_together(batches):
    """The towers' batches of one step with their ragged rows padded to the
    step's longest, so that the step's batches share one shape (and made
    plain numpy arrays); other leaves are left as they are."""
    flat = [keras.tree.flatten(b) for b in batches]
    if len({len(f) for f in flat}) != 1:
        return batches  # different structures: the caller reports them
    for position in range(len(flat[0])):
        leaves = [f[position] for f in flat]
        if all(isinstance(a, PaddedRows) for a in leaves) and len({a.ndim for a in leaves}) == 1:
            shape = tuple(max(dims) for dims in zip(*(a.shape[1:] for a in leaves)))
            for f, a in zip(flat, leaves):
                f[position] = _padded_to(a, shape)
    return [keras.tree.pack_sequence_as(b, f) for b, f in zip(batches, flat)]


def sparse_predictions_refused():
    """Why predict() on JAX does not join sparse outputs."""
    return KerasTowerError(
        "predict() got a sparse (BCOO) output from the model. On JAX, Keras joins "
        "predict's batches with np.concatenate, which turns a BCOO into an array of "
        "BCOO objects, not the predictions; kerastower refuses it instead. Make the "
        "output dense in the model (e.g. its last layer returns x.todense()), or call "
        "the model on the sparse batches yourself.")


def describe_mismatch(shapes):
    """Why predictions of these shapes (one per step) cannot be joined."""
    return DataMismatchError(
        "predict() cannot join its outputs: the steps gave outputs of shapes "
        f"{shapes}, which differ beyond the batch dimension. On JAX, Keras pads each "
        "batch's ragged rows to the batch's longest row (kerastower's towers pad to "
        "the longest of their step's batches), so a model whose outputs keep the "
        "padded width gives outputs of another width at every step; stock Keras-JAX "
        "cannot join them either (numpy refuses). Predict in one batch (a batch_size "
        "that holds every example), pad the rows to one length yourself, or reduce "
        "over the rows in the model.")
