"""InputSources: where each tower takes its batches from.

Nothing is split. Every tower takes whole batches of its own, so the batch
size you give is the per-tower batch and

    total batch = per-tower batch x number of towers.

```python
import kerastower as kt

kt.DatasetInput(dataset)            # one pipeline; towers take successive batches
kt.DatasetInput(lambda ctx: make(ctx.index, ctx.total))   # a pipeline per tower
kt.GeneratorInput(gen_fn, output_signature)   # Python source, prefetched
kt.DummyConstantInput((images, labels))       # constant batches, for benchmarks
```

`fit`, `evaluate` and `predict` also take plain `tf.data.Dataset`s (as
`DatasetInput`), numpy arrays (batched with `batch_size` per tower), and
Python generators, iterables and `keras.utils.PyDataset`s (backend/tensorflow/python_input.py);
`inputs/chooser.py` chooses the kind of each, and
`backend/tensorflow/inputs.py` makes its InputSource.
"""

import collections
import contextlib
import inspect

from kerastower._tf import tf
from kerastower.inputs import python_feed
from kerastower.inputs import step_failures
from kerastower.errors import InputSourceError

__all__ = [
    "InputSource",
    "DatasetInput",
    "GeneratorInput",
    "DummyConstantInput",
    "TowerInputContext",
]

TowerInputContext = collections.namedtuple("TowerInputContext", ["index", "total"])
TowerInputContext.__doc__ = """What a per-tower pipeline function is told:
`index` is the tower (0-based) whose pipeline is being built, `total` the
number of towers.

>>> kt.TowerInputContext(index=0, total=2)
TowerInputContext(index=0, total=2)
"""


class InputSource:
    """Base class: something that gives every tower its own batches.

    Subclasses implement `_tower_dataset(ctx)`, returning the `tf.data.Dataset`
    tower `ctx.index` reads, and set `per_tower`: False when all towers share
    one pipeline (each tower takes the next batch), True when each tower has
    its own.

    Examples:
        >>> import tensorflow as tf
        >>> class TowerIndex(kt.InputSource):
        ...     per_tower = True
        ...     def _tower_dataset(self, ctx):        # tower ctx.index of ctx.total
        ...         x = np.full((4, 3), ctx.index, "float32")
        ...         return tf.data.Dataset.from_tensors((x, np.zeros((4, 1), "float32"))).repeat()
        >>> x, y = next(iter(TowerIndex().tower_dataset(kt.TowerInputContext(index=1, total=2))))
        >>> x[0].numpy().tolist()
        [1.0, 1.0, 1.0]
    """

    per_tower = False

    def tower_dataset(self, ctx):
        """The dataset tower `ctx.index` of `ctx.total` reads from."""
        dataset = self._tower_dataset(ctx)
        if not isinstance(dataset, tf.data.Dataset):
            raise InputSourceError(
                f"{type(self).__name__} must give a tf.data.Dataset for tower "
                f"{ctx.index}; got {type(dataset).__name__}."
            )
        return dataset

    def _tower_dataset(self, ctx):
        raise NotImplementedError

    def reading(self):
        """A context for one run over this source: the background work of the
        iterators made inside it stops when it ends, whoever still holds
        one of them.

        A `GeneratorInput`'s read-ahead thread (prefetch > 0) stops and
        closes its generator once the item it is making is made (a
        generator is never closed mid-item); a generator read on demand
        (prefetch 0, and Python sources on TensorFlow) is closed when the
        run ends, or right after an item still being made. A
        `GeneratorInput` of other than dense numeric tensors runs in
        `from_generator`, which closes its generator when the iterator is
        destroyed. `fit`, `evaluate` and `predict` read their sources
        inside it; the source can be read again afterwards.

        Examples:
            >>> import tensorflow as tf
            >>> def batches():
            ...     while True:
            ...         yield np.ones((2, 3), "float32")
            >>> source = kt.GeneratorInput(batches, tf.TensorSpec((None, 3), tf.float32))
            >>> with source.reading():
            ...     first = next(iter(source.tower_dataset(kt.TowerInputContext(0, 1))))
            >>> first.shape.as_list()
            [2, 3]
        """
        return self._reading()

    def _reading(self):
        return contextlib.nullcontext()

    def distribute(self, strategy, skip_batches=None):
        """The per-tower batches of this source on a `TowerStrategy`.

        `skip_batches[i]` batches that tower i took before (a resumed run)
        are skipped: a shared pipeline skips their sum, so a deterministic
        pipeline goes on exactly where it stopped.
        """
        total = strategy.num_towers
        # Towers on CPU devices read plain host iterators, one per tower: a
        # shared pipeline that can deal itself out is copied per tower.
        dealt = not self.per_tower and total > 1 and strategy.host_fed() and self.deals_out
        common_spec = None
        if self.per_tower and total > 1:
            common_spec = _common_spec(
                [self.tower_dataset(TowerInputContext(i, total)).element_spec for i in range(total)]
            )

        def dataset_fn(input_context):
            index = input_context.input_pipeline_id if self.per_tower or dealt else 0
            if dealt:
                return self._tower_share(TowerInputContext(index, total), sum(skip_batches or [0]))
            dataset = self.tower_dataset(TowerInputContext(index, total))
            if skip_batches is not None:
                skip = skip_batches[index] if self.per_tower else sum(skip_batches)
                dataset = dataset.skip(skip)
            if common_spec is not None:
                dataset = _relax_to(dataset, common_spec)
            return dataset

        return strategy.place_input(dataset_fn, per_tower=self.per_tower or dealt)

    # Whether `_tower_share` can build tower i's share of a shared pipeline
    # (its batches i, i + N, ...) at no more cost than the shared one.
    deals_out = False

    def _tower_share(self, ctx, skip):
        """Tower `ctx.index`'s batches of the shared pipeline after `skip`
        batches: the ones it takes when the towers take successive batches."""
        raise NotImplementedError

    def element_spec(self, total):
        """The `tf.TensorSpec` structure of tower 0's batches."""
        return self.tower_dataset(TowerInputContext(0, total)).element_spec

    def endless(self, total):
        """Whether every tower's pipeline is endless (e.g. `.repeat()`), so a
        step never needs to ask whether some tower ran out."""
        indices = range(total) if self.per_tower else [0]
        return all(
            int(self.tower_dataset(TowerInputContext(i, total)).cardinality())
            == int(tf.data.INFINITE_CARDINALITY)
            for i in indices
        )

    def check_finite(self, total):
        """Raises when the input never ends: an epoch that is one pass over
        it (fit without steps_per_epoch) would never end."""
        cardinality = int(self.tower_dataset(TowerInputContext(0, total)).cardinality())
        if cardinality == int(tf.data.INFINITE_CARDINALITY):
            raise InputSourceError(
                f"The input ({type(self).__name__}) never ends (e.g. a dataset with "
                ".repeat()), and fit was not given steps_per_epoch, so the first "
                "epoch would never end. Pass steps_per_epoch (an epoch is then only "
                "the period at which callbacks run), or drop the .repeat()."
            )

    def fills_every_step(self, total):
        """Whether every step of a pass gives every one of `total` towers a
        batch: the towers' shares are known and of one length. A step then
        takes its batches without asking whether any is left, and a pass
        ends at its known length (`steps`).

        Examples:
            >>> import tensorflow as tf
            >>> six = kt.DatasetInput(tf.data.Dataset.range(12).batch(2))
            >>> six.fills_every_step(1), six.fills_every_step(2), six.fills_every_step(4)
            (True, True, False)
        """
        if self.per_tower:
            lengths = {int(self.tower_dataset(TowerInputContext(i, total)).cardinality())
                       for i in range(total)}
            length = lengths.pop() if len(lengths) == 1 else -1
        else:
            # A shared pipeline is taken in turns: tower k takes batches
            # k, k + N, ...
            cardinality = int(self.tower_dataset(TowerInputContext(0, total)).cardinality())
            length = cardinality // total if cardinality >= 0 and cardinality % total == 0 else -1
        # The loops stop at `steps` (a subclass may say otherwise than the
        # pipelines): only where the two agree is no step asked past the end.
        return length >= 0 and self.steps(total) == length

    def steps(self, total):
        """Steps in one pass over the data with `total` towers, or None."""
        if self.per_tower:
            # A pass lasts while any tower has a batch.
            lengths = [int(self.tower_dataset(TowerInputContext(i, total)).cardinality())
                       for i in range(total)]
            return None if min(lengths) < 0 else max(lengths)
        cardinality = int(self.tower_dataset(TowerInputContext(0, total)).cardinality())
        if cardinality < 0:
            return None
        return -(-cardinality // total)


def _common_spec(specs):
    """The most specific spec every tower's batches fit: towers may differ in
    shape (tower 0 8x8 images, tower 1 12x12), but one distributed iterator
    has one spec."""
    common = specs[0]
    for spec in specs[1:]:
        try:
            tf.nest.assert_same_structure(common, spec)
        except (TypeError, ValueError) as e:
            raise InputSourceError(
                "Per-tower pipelines must yield the same structure; got "
                f"{specs[0]} for tower 0 and {spec}: {e}"
            ) from None
        common = tf.nest.map_structure(
            lambda a, b: a.most_specific_common_supertype([b]), common, spec
        )
        if any(s is None for s in tf.nest.flatten(common)):
            raise InputSourceError(
                "Per-tower pipelines must yield the same dtypes and ranks; got "
                f"{specs[0]} for tower 0 and {spec} for another tower."
            )
    return common


def _relax_to(dataset, spec):
    """`dataset` with its element shapes loosened to `spec`; values unchanged."""
    if dataset.element_spec == spec:
        return dataset

    def relax(*elements):
        element = elements if isinstance(spec, tuple) else elements[0]
        return tf.nest.map_structure(
            lambda t, s: tf.compat.v1.placeholder_with_default(t, s.shape), element, spec
        )

    return dataset.map(relax)


class DatasetInput(InputSource):
    """A `tf.data` pipeline, shared by the towers or built once per tower.

    Args:
        dataset_or_fn: a batched `tf.data.Dataset`, from which the towers take
            successive batches (tensorpack's QueueInput behaviour: batch k of a
            step goes to tower k), or a function `fn(ctx)` that builds the
            batched pipeline of tower `ctx.index` out of `ctx.total`.

    Examples:
        >>> import tensorflow as tf
        >>> shared = kt.DatasetInput(tf.data.Dataset.range(8).batch(2))
        >>> per_tower = kt.DatasetInput(
        ...     lambda ctx: tf.data.Dataset.range(8).shard(ctx.total, ctx.index).batch(2))
        >>> per_tower.per_tower
        True
    """

    def __init__(self, dataset_or_fn):
        if isinstance(dataset_or_fn, tf.data.Dataset):
            self._dataset = dataset_or_fn
            self._fn = None
            self.per_tower = False
        elif callable(dataset_or_fn):
            self._dataset = None
            self._fn = dataset_or_fn
            self.per_tower = True
        else:
            raise InputSourceError(
                "DatasetInput takes a tf.data.Dataset or a function "
                f"fn(ctx) -> tf.data.Dataset; got {type(dataset_or_fn).__name__}."
            )

    def _tower_dataset(self, ctx):
        if self._fn is None:
            return self._dataset
        return self._fn(ctx)


class GeneratorInput(InputSource):
    """A Python generator of per-tower batches, run ahead in the background.

    Each item the generator yields is one tower's batch; the towers take
    successive items. The generator runs in a background thread, `prefetch`
    items ahead, so a slow Python source overlaps the training step instead
    of adding to it (kerastower/inputs/python_feed.py says how).

    Args:
        generator_fn: a callable with no arguments returning a fresh iterator.
        output_signature: the `tf.TensorSpec` structure of one item.
        prefetch: how many items to prepare ahead (0: each when it is taken).

    Examples:
        >>> import tensorflow as tf
        >>> def batches():
        ...     for _ in range(4):
        ...         yield np.ones((2, 3), "float32"), np.zeros((2,), "int32")
        >>> source = kt.GeneratorInput(batches, (
        ...     tf.TensorSpec((None, 3), tf.float32), tf.TensorSpec((None,), tf.int32)))
    """

    def __init__(self, generator_fn, output_signature, prefetch=4):
        if not callable(generator_fn) or inspect.isgenerator(generator_fn):
            raise InputSourceError(
                "GeneratorInput needs a function that returns a new generator "
                f"each time it is called; got {generator_fn!r}. Pass the "
                "function itself, e.g. GeneratorInput(my_gen, sig), not my_gen()."
            )
        self._generator_fn = generator_fn
        self._signature = output_signature
        self._prefetch = int(prefetch)
        self._feeds = python_feed.SourceFeeds()

    def _reading(self):
        return self._feeds.reading()

    def _tower_dataset(self, ctx):
        name = f"GeneratorInput({getattr(self._generator_fn, '__qualname__', repr(self._generator_fn))})"

        # tf.data passes on only the text of an exception; the step that
        # fails gives the user the exception itself, from the run's record.
        failures = step_failures.feeding_failures()

        def record(error, yielded):
            failures.record_generator_error(error, name, yielded, yielded % ctx.total)

        if python_feed.feedable(self._signature):
            return python_feed.feed_dataset(
                self._generator_fn, self._signature, self._prefetch, name, record, self._feeds)
        dataset = tf.data.Dataset.from_generator(
            lambda: self._recording_errors(record), output_signature=self._signature
        )
        return dataset.prefetch(self._prefetch)

    def _recording_errors(self, record):
        yielded = 0
        try:
            for item in self._generator_fn():
                yield item
                yielded += 1
        except Exception as error:
            record(error, yielded)
            raise


class DummyConstantInput(InputSource):
    """The same constant batch on every tower, every step, forever.

    For measuring the speed of the model alone, as tensorpack's
    DummyConstantInput. Each tower has its own endless pipeline.

    Args:
        batch: a structure (tuple, dict) of arrays, or of `tf.TensorSpec`s
            whose shapes are fully known (they become zeros).

    Examples:
        >>> source = kt.DummyConstantInput((np.zeros((4, 8), "float32"), np.zeros((4,), "int32")))
    """

    per_tower = True

    def __init__(self, batch):
        def to_tensor(leaf):
            if isinstance(leaf, tf.TensorSpec):
                if not leaf.shape.is_fully_defined():
                    raise InputSourceError(
                        f"DummyConstantInput needs full shapes; got {leaf}."
                    )
                return tf.zeros(leaf.shape, leaf.dtype)
            return tf.constant(leaf)

        self._batch = tf.nest.map_structure(to_tensor, batch)

    def _tower_dataset(self, ctx):
        return tf.data.Dataset.from_tensors(self._batch).repeat()
