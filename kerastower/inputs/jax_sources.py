"""Python generators and `keras.utils.PyDataset` as per-tower batches on JAX.

tensorpack's tower semantics, as for numpy arrays (jax_arrays.py): nothing
is split, every tower takes whole batches of its own, and the towers share
the source, dealt out in order: tower k of step s takes the source's batch
`s * N + k`. A step for which fewer than N batches are left runs on fewer
towers. Batches of one step that differ only in their number of examples
(a short last batch) run joined, as one tower: the update the towers would
make with their example-weighted reduce.

Examples:
    >>> import numpy as np
    >>> from kerastower.jax_sources import GeneratorBatches
    >>> batches = (np.full((2, 1), i, "float32") for i in range(5))
    >>> steps = GeneratorBatches(batches).one_pass(num_towers=2)
    >>> [[b[0][0, 0].item() for b in step] for step in steps]
    [[0.0, 1.0], [2.0, 3.0], [4.0]]
"""

import collections
import collections.abc
import concurrent.futures
import itertools
import operator

import jax
import keras
import numpy as np

from kerastower.errors import DataMismatchError
from kerastower.errors import InputSourceError
from kerastower.inputs.jax_arrays import ArrayBatches

__all__ = ["GeneratorBatches", "PyDatasetBatches", "tower_batches", "is_batched", "read_ahead"]


def is_batched(x):
    """Whether `x` yields batches itself (a PyDataset, a generator, an
    iterator or another iterable that is not an array container)."""
    if isinstance(x, keras.utils.PyDataset) or isinstance(x, collections.abc.Iterator):
        return True
    return (isinstance(x, collections.abc.Iterable)
            and not isinstance(x, (list, tuple, dict, str, bytes, np.ndarray))
            and not hasattr(x, "shape") and not hasattr(x, "__array__"))


def tower_batches(x, y=None, sample_weight=None, batch_size=None, shuffle=False):
    """What fit, evaluate and predict received, as per-tower batches.

    Examples:
        >>> import numpy as np
        >>> from kerastower.jax_sources import tower_batches
        >>> type(tower_batches(np.ones((4, 2)), batch_size=2)).__name__
        'ArrayBatches'
        >>> type(tower_batches(iter([np.ones((4, 2))]))).__name__
        'GeneratorBatches'
    """
    if isinstance(x, (ArrayBatches, _Batches)):
        return x
    if _is_tf_dataset(x):
        raise InputSourceError(
            "A tf.data.Dataset is TensorFlow's: on the JAX backend pass its batches as "
            "a Python generator, e.g. fit(dataset.as_numpy_iterator()) for one pass "
            "(with steps_per_epoch for a dataset that repeats), or use "
            "KERAS_BACKEND=tensorflow.")
    if not is_batched(x):
        return ArrayBatches(x, y, sample_weight, batch_size or 32, shuffle)
    kind = type(x).__name__
    if y is not None or sample_weight is not None:
        raise InputSourceError(
            f"y and sample_weight must be None when x is a {kind}: it yields "
            "(x, y, sample_weight) itself.")
    if batch_size is not None:
        raise InputSourceError(
            f"batch_size={batch_size} was given with a {kind}, whose batches are made "
            "already: each tower takes whole batches of the source. Leave batch_size unset.")
    if isinstance(x, keras.utils.PyDataset):
        return PyDatasetBatches(x, shuffle)
    return GeneratorBatches(x)


def _is_tf_dataset(x):
    return any(c.__name__ == "DatasetV2" and c.__module__.startswith("tensorflow.")
               for c in type(x).__mro__)


def _as_array(leaf, number):
    try:
        array = np.asarray(leaf)
    except Exception as error:  # the source's own types: anything may fail
        raise InputSourceError(
            f"Batch {number} of the input holds a {type(leaf).__name__} that cannot "
            f"become a numpy array ({type(error).__name__}: {error}).") from error
    if array.dtype.kind in "OSUV" or array.ndim == 0:
        raise InputSourceError(
            f"Batch {number} of the input holds a {type(leaf).__name__} that cannot "
            f"become a numpy array of numbers with a batch dimension (got dtype "
            f"{array.dtype}, shape {array.shape}). Yield x, (x, y) or (x, y, "
            "sample_weight) of numpy arrays, or lists and dicts of them.")
    return array


def standardized(item, number):
    """One batch as Keras unpacks it, `(x,)`, `(x, y)` or `(x, y, sample_weight)`,
    with numpy leaves (tf tensors and other array-likes converted)."""
    if isinstance(item, list):
        item = tuple(item)
    if not isinstance(item, tuple):
        item = (item,)
    if not 1 <= len(item) <= 3:
        raise InputSourceError(
            f"Batch {number} of the input is a tuple of {len(item)} elements; a batch is "
            "x, (x,), (x, y) or (x, y, sample_weight).")
    batch = jax.tree.map(lambda leaf: _as_array(leaf, number), item)
    if not jax.tree.leaves(batch):
        raise InputSourceError(f"Batch {number} of the input holds no array: {item!r}.")
    lengths = {a.shape[0] for a in jax.tree.leaves(batch)}
    if len(lengths) > 1:
        raise DataMismatchError(
            f"In batch {number} of the input, x, y and sample_weight must have the same "
            f"number of examples; got {sorted(lengths)}.")
    return batch


def _signature(batch):
    return (jax.tree.structure(batch),
            [(a.shape[1:], a.dtype) for a in jax.tree.leaves(batch)])


def one_step(batches, first_number):
    """The batches of one step as the towers take them: as they are when they
    have one shape; joined, as one tower, when only their numbers of examples
    differ; a DataMismatchError when they cannot form one step."""
    if all(_signature(b) == _signature(batches[0]) for b in batches[1:]):
        sizes = {jax.tree.leaves(b)[0].shape[0] for b in batches}
        if len(sizes) == 1:
            return batches
        return [jax.tree.map(lambda *parts: np.concatenate(parts), *batches)]
    raise DataMismatchError(
        f"Batches {first_number} to {first_number + len(batches) - 1} of the input are "
        "one step's (one per tower) but do not fit together: "
        + "; ".join(f"batch {first_number + i}: {jax.tree.map(np.shape, b)}, dtypes "
                    f"{[str(a.dtype) for a in jax.tree.leaves(b)]}"
                    for i, b in enumerate(batches))
        + ". The towers of one step need the same structure, dtypes and shapes "
        "(except the number of examples).")


def deal(items, num_towers, first_number=0):
    """Steps of up to `num_towers` consecutive batches from `items`, taking
    no item before its step runs."""
    items = iter(items)
    for number in itertools.count(first_number, num_towers):
        step = [standardized(item, number + i)
                for i, item in enumerate(itertools.islice(items, num_towers))]
        if not step:
            return
        yield one_step(step, number)


class _Batches:
    """A source of ready-made batches, dealt out to the towers in order."""

    never_ends = False

    def check_finite(self, method, argument=None):
        """Raises when the source never ends and `method` was given no
        number of steps (`argument`: the one to give)."""
        if not self.never_ends:
            return
        argument = argument or ("steps_per_epoch" if method == "fit" else "steps=")
        whole = "the first epoch" if argument == "steps_per_epoch" else "it"
        raise InputSourceError(
            f"The input ({self.kind}) never ends, and {method}() was not given "
            f"{argument}, so {whole} would never end. Pass {argument}"
            + (" (an epoch is then only the period at which callbacks run)."
               if argument == "steps_per_epoch" else " (steps of one batch per tower)."))


class GeneratorBatches(_Batches):
    """A Python generator, iterator or iterable of batches.

    An iterator (a generator) is one-shot: a pass goes on where the last one
    stopped. Any other iterable is iterated afresh for every pass. Each item
    is `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)`.

    Examples:
        >>> import itertools, numpy as np
        >>> from kerastower.jax_sources import GeneratorBatches
        >>> GeneratorBatches(itertools.repeat(np.ones((2, 3)))).never_ends
        True
    """

    def __init__(self, source):
        self._source = source
        self._one_shot = isinstance(source, collections.abc.Iterator)
        self._pending = []  # what first_batch read from a one-shot source
        self.kind = type(source).__name__
        self.never_ends = isinstance(source, (itertools.count, itertools.cycle)) or (
            isinstance(source, itertools.repeat) and operator.length_hint(source, -1) < 0)

    def steps(self, num_towers):
        """Steps in one pass, where the source has a length; else None."""
        if self._one_shot or not hasattr(self._source, "__len__"):
            return None
        return -(-len(self._source) // num_towers)

    def _items(self):
        if not self._one_shot:
            return iter(self._source)
        pending, self._pending = self._pending, []
        return itertools.chain(pending, self._source)

    def first_batch(self):
        """The source's first batch (what the model is built from), kept for
        the first step when the source is one-shot."""
        if self._one_shot:
            self._pending = self._pending or list(itertools.islice(self._source, 1))
            items = self._pending
        else:
            items = list(itertools.islice(iter(self._source), 1))
        if not items:
            raise InputSourceError(f"The input ({self.kind}) is empty: it gave no batch.")
        return standardized(items[0], 0)

    def one_pass(self, num_towers, pass_index=0, skip_steps=0):
        """One pass's steps, each a list of per-tower batches, from step `skip_steps` on.

        The steps before are read and dropped, so only a generator that
        gives the same batches in every run resumes exactly."""
        return itertools.islice(deal(self._items(), num_towers), skip_steps, None)

    def endless(self, num_towers, first_pass=0, skip_steps=0):
        """Steps for fit with steps_per_epoch, less the first `skip_steps`.

        A one-shot source once, to its end; an iterable pass after pass (an
        empty pass ends it). The skipped steps are read and dropped."""
        if self._one_shot:
            steps = deal(self._items(), num_towers)
        else:
            steps = self._passes(num_towers)
        return itertools.islice(steps, skip_steps, None)

    def _passes(self, num_towers):
        while True:
            any_step = False
            for step in self.one_pass(num_towers):
                any_step = True
                yield step
            if not any_step:
                return


def read_ahead(read, indices, workers, window):
    """`read(i)` for each of `indices`, in order, by `workers` threads that
    keep up to `window` batches read ahead (as Keras reads a PyDataset).

    Examples:
        >>> list(read_ahead(lambda i: i * i, range(5), workers=2, window=3))
        [0, 1, 4, 9, 16]
    """
    pending = collections.deque()
    indices = iter(indices)
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kt-pydataset") as pool:
        try:
            for index in itertools.islice(indices, window):
                pending.append(pool.submit(read, index))
            while pending:
                batch = pending.popleft().result()
                for index in itertools.islice(indices, 1):
                    pending.append(pool.submit(read, index))
                yield batch
        finally:  # the consumer stopped early: what is still queued is not read
            for future in pending:
                future.cancel()


class PyDatasetBatches(_Batches):
    """A `keras.utils.PyDataset`: tower k of step s takes batch `s * N + k` of
    the pass; with `workers > 1`, that many threads read up to
    `max_queue_size` batches ahead (`use_multiprocessing` too: in threads).

    A pass is `len(ds)` batches, `ceil(len(ds) / N)` steps, between
    `on_epoch_begin()` and `on_epoch_end()`. `shuffle` (fit's, as Keras)
    permutes the batch indices every pass, replayably from numpy's seed.

    Examples:
        >>> import keras, numpy as np
        >>> from kerastower.jax_sources import PyDatasetBatches
        >>> class Tens(keras.utils.PyDataset):
        ...     def __len__(self):
        ...         return 5
        ...     def __getitem__(self, i):
        ...         return np.full((2, 1), 10.0 * i), np.zeros(2)
        >>> source = PyDatasetBatches(Tens())
        >>> source.steps(num_towers=2)
        3
        >>> [[b[0][0, 0].item() for b in step] for step in source.one_pass(num_towers=2)]
        [[0.0, 10.0], [20.0, 30.0], [40.0]]
    """

    def __init__(self, dataset, shuffle=False):
        self._dataset = dataset
        self.kind = type(dataset).__name__
        self.length = dataset.num_batches
        self.never_ends = self.length is None
        self._shuffle = shuffle
        self.shuffle_seed = int(np.random.randint(2**31 - 1)) if shuffle else None
        self._first = None  # batch 0, once first_batch read it

    def steps(self, num_towers):
        """Steps in one pass, or None for a PyDataset without end."""
        return None if self.never_ends else -(-self.length // num_towers)

    def first_batch(self):
        """Batch 0 (what the model is built from), kept for when a pass reads it."""
        if self.length == 0:
            raise InputSourceError(f"The input ({self.kind}) is empty: its length is 0.")
        if self._first is None:
            self._first = [self._dataset[0]]
        return standardized(self._first[0], 0)

    def _read(self, index):
        if index == 0 and self._first is not None:
            (batch,), self._first = self._first, None
            return batch
        return self._dataset[index]

    def _order(self, pass_index):
        if self.never_ends:
            return itertools.count()
        if not self._shuffle:
            return range(self.length)
        return np.random.default_rng([self.shuffle_seed, pass_index]).permutation(self.length).tolist()

    def _pass(self, pass_index, skip=0):
        self._dataset.on_epoch_begin()
        last = -1 if self.never_ends else self.length - 1
        # Positions taken before a resume are not read again.
        positions = itertools.islice(enumerate(self._order(pass_index)), skip, None)
        workers = int(getattr(self._dataset, "workers", 1) or 1)
        if workers > 1:
            read = lambda item: (item[0], self._read(item[1]))  # noqa: E731
            window = max(int(getattr(self._dataset, "max_queue_size", 10) or 10), workers)
            positions = read_ahead(read, positions, workers, window)
        else:
            positions = ((position, self._read(index)) for position, index in positions)
        for position, batch in positions:
            if position == last:
                self._dataset.on_epoch_end()
            yield batch
        if self.length == 0:
            self._dataset.on_epoch_end()

    def one_pass(self, num_towers, pass_index=0, skip_steps=0):
        """One pass's steps, from step `skip_steps` on (the batches before are not read).

        `on_epoch_begin()` is called before its first batch is read,
        `on_epoch_end()` once its last one was."""
        skip = skip_steps * num_towers
        return deal(self._pass(pass_index, skip), num_towers, first_number=skip)

    def endless(self, num_towers, first_pass=0, skip_steps=0):
        """Pass after pass, for fit with steps_per_epoch, less the first `skip_steps` steps."""
        if self.length == 0:
            return iter(())
        if not self.never_ends:
            per_pass = self.steps(num_towers)
            first_pass += skip_steps // per_pass
            skip_steps %= per_pass
        return itertools.chain(
            self.one_pass(num_towers, first_pass, skip_steps),
            itertools.chain.from_iterable(
                self.one_pass(num_towers, p) for p in itertools.count(first_pass + 1)))
