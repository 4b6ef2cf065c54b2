"""numpy arrays as an InputSource: per-tower batches, reshuffled every pass.

What `fit(x, y, batch_size=...)` trains on: `as_input_source` (sources.py)
makes one from arrays, with `batch_size` examples per tower. As Keras's
array adapter on TensorFlow, it also takes `tf.RaggedTensor`s and
`tf.SparseTensor`s, whose rows are gathered as a dense array's are.
"""

import numpy as np
import tensorflow as tf

from kerastower.errors import InputSourceError
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


class ArrayInput(DatasetInput):
    """numpy arrays cut into per-tower batches, reshuffled every pass.

    Elements are laid out as Keras unpacks them: `(x,)`, `(x, y)` or
    `(x, y, sample_weight)`. With `repeat`, the passes follow each other
    endlessly (for `steps_per_epoch`), each one reshuffled.
    """

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
        self._length = lengths.pop()
        self._shuffle = shuffle
        self._repeat = repeat
        # An explicit seed (from numpy's generator, which
        # keras.utils.set_random_seed seeds) makes the order replayable.
        self._seed = int(np.random.randint(2**31 - 1)) if shuffle else None
        self.batch_size = batch_size
        super().__init__(self._make_dataset())

    deals_out = True

    def _tower_share(self, ctx, skip):
        # One index stream per tower, kept: its reshuffling moves on once
        # per pass (per iterator), so a resumed pass's copy, made later,
        # goes on with the order of the pass it resumes, as the shared
        # pipeline does.
        key = (ctx.index, ctx.total, self._seed)
        if key not in self._tower_streams:
            self._tower_streams[key] = self._index_batches()
        return self._gathered(self._tower_streams[key].skip(skip).shard(ctx.total, ctx.index))

    def _make_dataset(self):
        self._tower_streams = {}
        return self._gathered(self._index_batches())

    def _index_batches(self):
        # Batches of example indices, shuffled as the examples would be (a
        # shuffle's order depends on its seed and size only), then one
        # gather per batch (`_gathered`): far cheaper than slicing every
        # example and batching them one by one.
        indices = tf.data.Dataset.range(self._length)
        if self._shuffle:
            indices = indices.shuffle(self._length, seed=self._seed, reshuffle_each_iteration=True)
        if self._repeat:
            # Endless, so every tower always gets a whole batch: a static
            # batch size (when the passes divide evenly) spares the step
            # reducing the towers' example counts.
            whole = self._length % self.batch_size == 0
            indices = indices.batch(self.batch_size, drop_remainder=whole).repeat()
        else:
            indices = indices.batch(self.batch_size)
        return indices

    def _gathered(self, indices):
        arrays = tf.data.Dataset.from_tensors(self._element).repeat()
        return tf.data.Dataset.zip((indices, arrays)).map(
            lambda batch, element: tf.nest.map_structure(lambda a: gather_rows(a, batch), element),
            num_parallel_calls=tf.data.AUTOTUNE, deterministic=True,
        ).prefetch(tf.data.AUTOTUNE)

    def distribute(self, strategy, skip_batches=None):
        if self._shuffle:
            # Every process must shuffle alike before taking its shard, or
            # the shards would overlap: the chief's seed wins.
            seed = strategy.broadcast_object(self._seed)
            if seed != self._seed:
                self._seed = seed
                self._dataset = self._make_dataset()
        return super().distribute(strategy, skip_batches=skip_batches)
