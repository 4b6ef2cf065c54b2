"""numpy arrays as an InputSource: per-tower batches, reshuffled every pass.

What `fit(x, y, batch_size=...)` trains on: the TensorFlow engine's placing
(inputs.py) makes one of what the chooser found to be arrays, with `batch_size` examples per tower. Which rows
each batch holds, pass by pass, is decided by `ArrayRows` (array_rows.py),
as on JAX; this module gathers them in a tf.data pipeline. As Keras's
array adapter on TensorFlow, it also takes `tf.RaggedTensor`s and
`tf.SparseTensor`s, whose rows are gathered as a dense array's are.
"""

import copy

import numpy as np
import tensorflow as tf

from kerastower.errors import InputSourceError
from kerastower.inputs.array_rows import ArrayRows
from kerastower.inputs.sources import DatasetInput

__all__ = ["ArrayInput"]


def _lists_to_tuples(structure):
    """Keras reads a list of arrays as several inputs; tf.data would stack it."""
    if isinstance(structure, list):
        return tuple(_lists_to_tuples(v) for v in structure)
    if isinstance(structure, tuple):
        return tuple(_lists_to_tuples(v) for v in structure)
    if isinstance(structure, dict):
        return {k: _lists_to_tuples(v) for k, v in structure.items()}
    return structure


def packed(x, y=None, sample_weight=None):
    """One example's structure as Keras packs it for the step: `x` alone
    when there is no `y` (a tuple `x` wrapped, `(x,)`, so it reads as
    inputs, not as x and y), else `(x, y)` or `(x, y, sample_weight)`.

    >>> packed("x"), packed(("a", "b")), packed("x", "y")
    ('x', (('a', 'b'),), ('x', 'y'))
    """
    if y is None and sample_weight is None:
        return (x,) if isinstance(x, tuple) else x
    return tuple(a for a in (x, y, sample_weight) if a is not None)


def _length(array):
    if isinstance(array, tf.SparseTensor):
        return int(array.dense_shape[0])
    if isinstance(array, tf.RaggedTensor):
        return int(array.nrows())
    return int(np.shape(array)[0])


def gather_rows(array, rows):
    """Rows `rows` (distinct) of a tensor, a RaggedTensor or a SparseTensor."""
    if not isinstance(array, tf.SparseTensor):
        return tf.gather(array, rows)
    # A SparseTensor has no gather: each kept entry's row is renumbered by
    # its position in `rows`.
    rows = tf.cast(rows, tf.int64)
    length = array.dense_shape[0]
    position = tf.scatter_nd(rows[:, None], tf.range(tf.size(rows, tf.int64)), [length])
    wanted = tf.scatter_nd(rows[:, None], tf.ones_like(rows, tf.bool), [length])
    keep = tf.gather(wanted, array.indices[:, 0])
    indices = tf.boolean_mask(array.indices, keep)
    indices = tf.concat([tf.gather(position, indices[:, :1]), indices[:, 1:]], axis=1)
    dense_shape = tf.concat([[tf.size(rows, tf.int64)], array.dense_shape[1:]], axis=0)
    return tf.sparse.reorder(tf.SparseTensor(indices, tf.boolean_mask(array.values, keep), dense_shape))


def _as_tensor(array):
    if isinstance(array, (tf.SparseTensor, tf.RaggedTensor)):
        return array
    return tf.convert_to_tensor(array)


def _batch_spec(array):
    """The spec of a batch of `array`'s rows, its batch size open."""
    if isinstance(array, (tf.SparseTensor, tf.RaggedTensor)):
        return tf.data.Dataset.from_tensor_slices(array).batch(1).element_spec
    return tf.TensorSpec((None,) + tuple(np.shape(array)[1:]), tf.convert_to_tensor(array[:1]).dtype)


class ArrayInput(DatasetInput):
    """numpy arrays cut into per-tower batches, reshuffled every pass.

    Elements are laid out as Keras unpacks them: `(x,)`, `(x, y)` or
    `(x, y, sample_weight)`. With `repeat`, the passes follow each other
    endlessly (for `steps_per_epoch`), each one reshuffled. The order of
    pass p is `ArrayRows.order(p)`, the same on every backend.
    """

    # The engine opens every pass with its index (`distribute(...,
    # pass_index=)`), so a pass's order is the pass's, resumes included.
    pass_indexed = True
    deals_out = True

    def __init__(self, x, y, sample_weight, batch_size, shuffle, repeat=False):
        if y is None and sample_weight is not None:
            raise InputSourceError(
                "sample_weight was given without y; kerastower needs targets to "
                "weight. Pass y, or put the weights into the loss yourself."
            )
        x, y, sample_weight = (_lists_to_tuples(a) for a in (x, y, sample_weight))
        element = packed(x, y, sample_weight)
        lengths = {_length(a) for a in tf.nest.flatten(element)}
        if len(lengths) != 1:
            raise InputSourceError(
                "x, y and sample_weight must have the same number of examples; "
                f"got lengths {sorted(lengths)}."
            )
        self._element = element
        self._repeat = repeat
        self.batch_size = batch_size
        self.rows = ArrayRows(lengths.pop(), batch_size, shuffle)
        self._first_pass = 0
        # Built when first read (building traces the gather): a fit on one
        # tower reads the passes in a row instead (`passes_in_a_row`).
        self._dataset, self._fn, self.per_tower = None, None, False
        self._built_for = None
        self._tensors = None  # the arrays as tensors, made when first gathered
        self._index_cache = None  # ((first pass, seed), the index batches)

    def element_spec(self, total):
        """The spec of a batch, from the arrays (no pipeline is built)."""
        return tf.nest.map_structure(_batch_spec, self._element)

    def _tower_dataset(self, ctx):
        # Kept while the pass and seed stay: building traces the gather.
        if self._built_for != (self._first_pass, self.rows.seed):
            self._dataset = self._gathered(self._index_batches())
            self._built_for = (self._first_pass, self.rows.seed)
        return self._dataset

    def _tower_share(self, ctx, skip):
        return self._gathered(self._index_batches().skip(skip).shard(ctx.total, ctx.index))

    def _index_batches(self):
        """The row indices of every batch, from pass `_first_pass` on (one
        pass, or endless with `repeat`): one gather per batch then takes
        the rows (`_gathered`), far cheaper than batching rows one by one.
        Kept while the pass and seed stay (the towers' shares read it)."""
        key = (self._first_pass, self.rows.seed)
        if self._index_cache is None or self._index_cache[0] != key:
            self._index_cache = (key, self._make_index_batches())
        return self._index_cache[1]

    def _make_index_batches(self):
        rows = self.rows
        if not self._repeat:
            # One pass: its order is known now. Batched as tf.data batches
            # (its last batch may be short, so the batch size stays open and
            # tf.distribute hands towers short of a batch empty ones).
            return tf.data.Dataset.from_tensor_slices(rows.order(self._first_pass)).batch(rows.batch_size)
        full_batches, rest = divmod(rows.length, rows.batch_size)
        lengths = [rows.batch_size] * full_batches + ([rest] if rest else [])

        def batches_of(pass_index):
            order = tf.numpy_function(rows.order, [pass_index], tf.int64, stateful=False)
            order = tf.ensure_shape(order, [rows.length])
            if not rest:
                return tf.reshape(order, [full_batches, rows.batch_size])
            return tf.RaggedTensor.from_row_lengths(order, tf.constant(lengths, tf.int64))

        # Endless, so every tower always gets a whole batch: a static batch
        # size (when the passes divide evenly) spares the step reducing the
        # towers' example counts. A pass's batches are one element, then
        # unbatched: cheaper per step than a dataset per pass (flat_map).
        return tf.data.Dataset.counter(self._first_pass).map(batches_of).unbatch()

    def _gathered(self, indices):
        if self._tensors is None:
            # Copied into tensors once, not at every pipeline built.
            self._tensors = tf.nest.map_structure(_as_tensor, self._element)
        arrays = tf.data.Dataset.from_tensors(self._tensors).repeat()
        return tf.data.Dataset.zip((indices, arrays)).map(
            lambda batch, element: tf.nest.map_structure(lambda a: gather_rows(a, batch), element),
            num_parallel_calls=tf.data.AUTOTUNE, deterministic=True,
        ).prefetch(tf.data.AUTOTUNE)

    def distribute(self, strategy, skip_batches=None, pass_index=0):
        """Pass `pass_index`'s batches (and the passes after it, with
        `repeat`) on `strategy`'s towers, less the batches each tower took
        before (`skip_batches`)."""
        if self.rows.shuffle and self.rows.pass_order is None:
            # Every process must shuffle alike before taking its shard, or
            # the shards would overlap: the chief's seed wins.
            self.rows.seed = strategy.broadcast_object(self.rows.seed)
        self._first_pass = pass_index
        return super().distribute(strategy, skip_batches=skip_batches)

    def endless(self, total):
        return self._repeat

    def passes_in_a_row(self):
        """These arrays read pass after pass as one endless stream (pass p's
        batches, then pass p+1's, each pass ordered as `ArrayRows.order`):
        one placement and one iterator serve every epoch of a `fit` on one
        tower, whose epochs take exactly a pass's batches each."""
        stream = copy.copy(self)
        stream._repeat = True
        stream._index_cache = None
        stream._built_for = None
        return stream

    def check_finite(self, total):
        """Arrays end, unless repeated for `steps_per_epoch`."""
        if self._repeat:
            super().check_finite(total)

    def steps(self, total):
        return None if self._repeat else self.rows.num_steps(total)

    def fills_every_step(self, total):
        return (not self._repeat and self.rows.num_batches() % total == 0
                and self.steps(total) == self.rows.num_steps(total))
