"""A Python source of batches as an InputSource: generators, iterables and
`keras.utils.PyDataset`s on the TensorFlow engine.

The source is read as on JAX (python_sources.py): in passes, dealt out in
order, tower k of step s taking batch `s * N + k` of the pass, nothing read
before its step is due. The batches reach tf.data through python_feed.py
(a thread-free feed here: prefetch 0, tf.data's own prefetch off), so a
generator that fit stops early goes on where fit stopped, as on JAX.

Every tower reads a pipeline of its own, handed its batches by one
`TowerDealer` per pass (on GPUs, tf.distribute's prefetch to the device
may read a batch ahead). Under "multiworker" with several towers per
worker, where TensorFlow builds one pipeline per worker, the worker's
towers share one and the strategy deals it, batch by batch.

The batches' `tf.TensorSpec`s come from the source's first two batches, as
Keras's own generator adapter takes them: the batch dimension and any
dimension in which the two differ are left open. A later batch that fits
neither is an InputSourceError naming both shapes.

Examples:
    >>> from kerastower.backend.tensorflow.python_input import PythonSourceInput
    >>> from kerastower.backend.tensorflow.inputs import as_input_source
    >>> source = as_input_source(iter([(np.ones((4, 3)), np.zeros(4))] * 2))
    >>> isinstance(source, PythonSourceInput), source.element_spec(2)[0].shape.as_list()
    (True, [None, 3])
"""

import contextlib

import numpy as np

from kerastower._tf import tf
from kerastower.errors import DataMismatchError
from kerastower.inputs import python_feed
from kerastower.inputs import python_sources
from kerastower.inputs import step_failures
from kerastower.inputs.dealing import TowerDealer
from kerastower.inputs.dealing import failed_batch
from kerastower.inputs.dealing import standardized
from kerastower.inputs.sources import InputSource

__all__ = ["PythonSourceInput"]

_SPEC_BATCHES = 2  # batches the TensorSpecs are taken from, as in Keras's adapters


def _open_dims(arrays):
    """A `tf.TensorSpec` for leaves `arrays` (one per peeked batch): the batch
    dimension and the dimensions in which they differ open."""
    first = arrays[0]
    dims = [None] + [d if all(a.shape[i + 1] == d for a in arrays[1:]) else None
                     for i, d in enumerate(first.shape[1:])]
    return tf.TensorSpec(dims, tf.as_dtype(first.dtype))


def _layout(batch):
    return (tf.nest.map_structure(lambda _: 0, batch),
            [(a.ndim, a.dtype) for a in tf.nest.flatten(batch)])


def _describe(batch):
    return (f"shapes {tf.nest.map_structure(lambda a: tuple(a.shape), batch)}, dtypes "
            f"{[str(a.dtype) for a in tf.nest.flatten(batch)]}")


def _empty(spec):
    """A batch of no example for `spec`."""
    return np.zeros([0] + [d or 0 for d in spec.shape.as_list()[1:]], spec.dtype.as_numpy_dtype)


def _tuples(structure):
    """Lists as tuples: tf.data would stack a list into one tensor, where
    Keras reads it as several inputs."""
    if isinstance(structure, (list, tuple)):
        return tuple(_tuples(v) for v in structure)
    if isinstance(structure, dict):
        return {k: _tuples(v) for k, v in structure.items()}
    return structure


class PythonSourceInput(InputSource):
    """A `kerastower.inputs.python_sources` source on TensorFlow's towers.

    Args:
        source: a `GeneratorBatches` or `PyDatasetBatches`.
        repeat: pass after pass (fit with `steps_per_epoch`).
    """

    # The TensorFlow feed distributes it afresh for every pass
    # (`distribute(..., pass_index=)`): a pass's order and its dealer are the pass's.
    pass_indexed = True
    deals_out = False

    def __init__(self, source, repeat=False):
        self.source = source
        self.repeat = repeat
        self.kind = source.kind
        self._signature = None
        self._feeds = python_feed.SourceFeeds()
        self._agreed = False  # whether the processes agreed on the order

    @contextlib.contextmanager
    def _reading(self):
        with self._feeds.reading():
            if getattr(self.source, "method", None):
                # Stock Keras reads a PyDataset's spec before it resets it.
                self.signature()
            with python_sources.reading(self.source):
                yield

    @property
    def per_tower(self):
        return False

    def signature(self):
        """The `tf.TensorSpec` structure of one batch (from the first two)."""
        if self._signature is None:
            batches = [_tuples(b) for b in self.source.first_batches(_SPEC_BATCHES)]
            first = batches[0]
            for number, batch in enumerate(batches[1:], 1):
                if _layout(batch) != _layout(first):
                    raise DataMismatchError(
                        f"Batch 0 and batch {number} of the input ({self.kind}) do not fit "
                        f"together: {_describe(first)} and {_describe(batch)}. Every batch "
                        "needs the same structure, ranks and dtypes (sizes may differ).")
            leaves = [tf.nest.flatten(b) for b in batches]
            specs = [_open_dims([parts[i] for parts in leaves]) for i in range(len(leaves[0]))]
            self._signature = tf.nest.pack_sequence_as(first, specs)
        return self._signature

    def element_spec(self, total):
        return self.signature()

    def steps(self, total):
        return self.source.steps(total)

    def endless(self, total):
        return self.source.never_ends

    def fills_every_step(self, total):
        # A Python source's length is what it says, not what it gives: each
        # step asks whether a batch is left.
        return False

    def check_finite(self, total):
        self.source.check_finite("fit")

    def _steps(self, total, pass_index, skip_steps):
        if self.repeat:
            return self.source.raw_endless(total, skip_steps)
        return self.source.raw_pass(total, pass_index, skip_steps)

    def _feed(self, make_items, tower, total):
        name = f"The input ({self.kind})"
        # Taken now, while the run that reads the feed builds it: the
        # generator raises in tf.data's thread.
        failures = step_failures.feeding_failures()

        def record(error, good):
            # The batch the source failed making, where dealing marked it:
            # its tower, not the one whose pipeline asked first.
            batch = failed_batch(error)
            if batch is not None and batch[1] != total:
                batch = None  # one pipeline a strategy deals out: its numbers are not the towers'
            failures.record_generator_error(error, name, good, tower, batch)

        dataset = python_feed.feed_dataset(make_items, self.signature(), 0, name, record, self._feeds)
        options = tf.data.Options()
        # Nothing is read before its step is due (see the module).
        options.experimental_optimization.inject_prefetch = False
        return dataset.with_options(options)

    def _tower_dataset(self, ctx):
        return self._feed(lambda: self._items_of(self._steps(ctx.total, 0, 0)), 0, ctx.total)

    @staticmethod
    def _items_of(steps):
        for step in steps:
            for number, item in step:
                yield _tuples(standardized(item, number))

    def distribute(self, strategy, skip_batches=None, pass_index=0):
        """Pass `pass_index`'s batches on `strategy`'s towers (every pass,
        with `repeat`), less the `skip_batches` each tower took before.

        Each call opens one pass: iterate what it returns once."""
        total = strategy.num_towers
        skip_steps = max(skip_batches) if skip_batches else 0
        if not self._agreed and not strategy.single_process:
            # Every process deals the same order: the chief's wins. Once,
            # before the first pass draws its order.
            self._agreed = True
            if getattr(self.source, "shuffle_seed", None) is not None:
                self.source.shuffle_seed = strategy.broadcast_object(self.source.shuffle_seed)

        def steps():
            return self._steps(total, pass_index, skip_steps)

        if total > 1 and (strategy.single_process or getattr(strategy, "local_towers", 1) == 1):
            dealer = TowerDealer(steps, total)  # opened when a tower first asks

            def tower_items(tower):
                while (taken := dealer.take(tower)) is not None:
                    number, item = taken
                    if number is not None:
                        yield _tuples(standardized(item, number))
                    elif self.repeat:
                        # A pass's short last step, pass after pass: this
                        # tower takes no example in it, as on JAX.
                        yield tf.nest.map_structure(_empty, self.signature())
                    else:
                        return

            def dataset_fn(context):
                tower = context.input_pipeline_id
                return self._feed(lambda: tower_items(tower), tower, total)

            return strategy.place_input(dataset_fn, per_tower=True)

        # One pipeline the strategy deals out (one tower, or several towers
        # per worker under "multiworker"): batch by batch, so with `repeat` a
        # step may take the end of one pass and the start of the next.
        skip = sum(skip_batches) if skip_batches else 0

        def dataset_fn(context):
            return self._feed(lambda: self._items_of(self._steps(1, pass_index, skip)), 0, total)

        return strategy.place_input(dataset_fn, per_tower=False)
