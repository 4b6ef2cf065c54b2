"""Reading Python sources of ready-made batches in passes, on every backend.

Holds the sources: generators, iterables, `keras.utils.PyDataset`s (and, on
JAX, `tf.data.Dataset`s, as Keras reads them there: as an iterable of numpy
batches), as `GeneratorBatches` and `PyDatasetBatches`. A PyDataset is read
by Keras's own reader (its `PyDatasetAdapter`: worker threads or processes,
the queue, the epoch hooks), given each pass's batches in kerastower's order.

tensorpack's tower semantics, as for numpy arrays: nothing is split, every
tower takes whole batches of its own, and the towers share the source,
dealt out in order: tower k of step s takes the source's batch `s * N + k`
(the dealing is `dealing.py`'s). A step for which fewer than N batches are
left runs on fewer towers. Nothing is read before its step is due, except
by a PyDataset's worker threads (reading ahead by index consumes nothing),
so a generator that fit stops early goes on where fit stopped. A PyDataset
is also read, and its `on_epoch_begin` / `on_epoch_end` called, where
stock Keras does so besides its passes (`PyDatasetBatches`), so that a
dataset that changes itself in its hooks trains as in stock Keras.

A source is read in passes: `batches(pass_index, skip)` gives one pass's
batches from batch `skip` on. A PyDataset's batches before `skip` are not
read; a generator's are read and dropped, so a resumed run is exact when
the generator gives the same batches in every run.

This module imports neither TensorFlow nor JAX: the JAX engine places the
batches itself (`backend/jax/inputs.py`), and the TensorFlow engine feeds
them to tf.data (`backend/tensorflow/python_input.py`).

Examples:
    >>> from kerastower.inputs.python_sources import GeneratorBatches
    >>> batches = (np.full((2, 1), i, "float32") for i in range(5))
    >>> steps = GeneratorBatches(batches).one_pass(num_towers=2)
    >>> [[b[0, 0].item() for b in step] for step in steps]
    [[0.0, 1.0], [2.0, 3.0], [4.0]]
"""

import collections.abc
import contextlib
import itertools
import operator
import random

import keras
import numpy as np

from kerastower import _compat
from kerastower.errors import InputSourceError
from kerastower.inputs import keras_order
from kerastower.inputs import ragged_sparse
from kerastower.inputs.dealing import joined
from kerastower.inputs.dealing import mark_failed_batch
from kerastower.inputs.dealing import numbered_steps
from kerastower.inputs.dealing import standardized
# Dealt here before dealing.py held them: still importable from this path.
from kerastower.inputs.dealing import TowerDealer  # noqa: F401
from kerastower.inputs.dealing import deal  # noqa: F401

__all__ = ["GeneratorBatches", "PyDatasetBatches", "python_batches", "is_batched", "read_by",
           "reading", "epoch_begins", "epoch_ends"]


def is_batched(x):
    """Whether `x` yields batches itself (a PyDataset, a generator, an
    iterator or another iterable that is not an array container, such as a
    `tf.data.Dataset` or a torch `DataLoader`)."""
    if isinstance(x, keras.utils.PyDataset) or isinstance(x, collections.abc.Iterator):
        return True
    return (isinstance(x, collections.abc.Iterable)
            and not isinstance(x, (list, tuple, dict, str, bytes, np.ndarray))
            and not hasattr(x, "shape") and not hasattr(x, "__array__"))


def python_batches(x, y=None, sample_weight=None, batch_size=None, shuffle=False):
    """A source that `is_batched`, as a source of batches.

    Examples:
        >>> from kerastower.inputs.python_sources import python_batches
        >>> type(python_batches(iter([]))).__name__
        'GeneratorBatches'
    """
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


class _Batches:
    """A source of ready-made batches, read in passes (see the module).

    Subclasses give `_pass_items(pass_index, skip)`, one pass's items from
    position `skip` on, and `raw_endless`."""

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

    def raw_pass(self, num_towers, pass_index=0, skip_steps=0):
        """One pass's steps of (number, item) pairs, from step `skip_steps` on."""
        skip = skip_steps * num_towers
        return numbered_steps(self._pass_items(pass_index, skip), num_towers, first_number=skip)

    def one_pass(self, num_towers, pass_index=0, skip_steps=0):
        """One pass's steps, each a list of per-tower batches, from step `skip_steps` on."""
        return map(joined, self.raw_pass(num_towers, pass_index, skip_steps))

    def endless(self, num_towers, first_pass=0, skip_steps=0):
        """Steps for fit with steps_per_epoch, pass after pass (a pass's
        short last step runs on fewer towers), less the first `skip_steps`."""
        return map(joined, self.raw_endless(num_towers, skip_steps))


class GeneratorBatches(_Batches):
    """A Python generator, iterator or iterable of batches.

    An iterator (a generator) is one-shot: a pass goes on where the last one
    stopped. Any other iterable (a `tf.data.Dataset`, a torch `DataLoader`)
    is iterated afresh for every pass. Each item is `x`, `(x,)`, `(x, y)` or
    `(x, y, sample_weight)`.

    Examples:
        >>> import itertools
        >>> from kerastower.inputs.python_sources import GeneratorBatches
        >>> GeneratorBatches(itertools.repeat(np.ones((2, 3)))).never_ends
        True
    """

    def __init__(self, source):
        self._source = source
        self._one_shot = isinstance(source, collections.abc.Iterator)
        self._pending = []  # what first_batches read from a one-shot source
        self.kind = type(source).__name__
        self.never_ends = isinstance(source, (itertools.count, itertools.cycle)) or (
            isinstance(source, itertools.repeat) and operator.length_hint(source, -1) < 0
        ) or self._cardinality() == -1

    def _cardinality(self):
        # A tf.data.Dataset's number of batches: -1 endless, -2 unknown.
        cardinality = getattr(self._source, "cardinality", None)
        return int(cardinality()) if callable(cardinality) else -2

    def steps(self, num_towers):
        """Steps in one pass, where the source has a length; else None."""
        if self._one_shot:
            return None
        length = self._cardinality()
        # A tf.data.Dataset of unknown cardinality has a __len__ that raises.
        has_cardinality = callable(getattr(self._source, "cardinality", None))
        if length == -2 and not has_cardinality and hasattr(self._source, "__len__"):
            length = len(self._source)
        return None if length < 0 else -(-length // num_towers)

    def _items(self):
        if not self._one_shot:
            return iter(self._source)
        pending, self._pending = self._pending, []
        # A chain, not the user's generator: closing it leaves theirs open.
        return itertools.chain(pending, self._source)

    def first_batches(self, count=1, composite_leaf=None):
        """Up to `count` first batches of the source (what the model is built
        from), kept for the first pass when the source is one-shot (ragged and
        sparse leaves: `dealing.standardized`)."""
        if self._one_shot:
            if len(self._pending) < count:
                self._pending += list(itertools.islice(self._source, count - len(self._pending)))
            items = self._pending[:count]
        else:
            items = list(itertools.islice(iter(self._source), count))
        if not items:
            raise InputSourceError(f"The input ({self.kind}) is empty: it gave no batch.")
        return [standardized(item, i, composite_leaf) for i, item in enumerate(items)]

    def first_batch(self):
        """The source's first batch, as the JAX towers take it (the JAX engine
        builds the model from it)."""
        return self.first_batches(1, ragged_sparse.for_jax)[0]

    def _pass_items(self, pass_index=0, skip=0):
        # A pass: a one-shot source to its end, an iterable afresh; the
        # first `skip` batches are read and dropped.
        return itertools.islice(self._items(), skip, None)

    def raw_endless(self, num_towers, skip_steps=0):
        """A one-shot source once, to its end; an iterable pass after pass
        (an empty pass ends it). The first `skip_steps` steps are read and dropped."""
        if self._one_shot:
            steps = numbered_steps(self._items(), num_towers)
        else:
            steps = self._passes(num_towers)
        return itertools.islice(steps, skip_steps, None)

    def _passes(self, num_towers):
        while True:
            any_step = False
            for step in self.raw_pass(num_towers):
                any_step = True
                yield step
            if not any_step:
                return


class _PassOfDataset(keras.utils.PyDataset):
    """One pass of a PyDataset, in kerastower's order from position `skip`
    on, as a PyDataset for Keras's reader: its batch j is the dataset's batch
    `order[skip + j]` (`skip + j` without an order: the dataset never ends),
    read with the dataset's workers. The dataset's own `on_epoch_begin` ran
    before (`PyDatasetBatches._pass`); its `on_epoch_end` runs here once the
    pass is `complete`."""

    def __init__(self, source, order, skip):
        dataset = source._dataset
        super().__init__(workers=dataset.workers, use_multiprocessing=dataset.use_multiprocessing,
                         max_queue_size=dataset.max_queue_size)
        self._source, self._order, self._skip = source, order, skip
        self.complete = False

    @property
    def num_batches(self):
        return None if self._order is None else max(len(self._order) - self._skip, 0)

    def __getitem__(self, position):
        position += self._skip
        index = position if self._order is None else self._order[position]
        try:
            return self._source._dataset[index]
        except Exception as error:
            # Keras's reader reads ahead: the batch's number in the pass,
            # for the error to name its tower (dealing.failed_batch).
            mark_failed_batch(error, position, index=None if index == position else index)
            raise

    def on_epoch_end(self):
        if self.complete:
            self.complete = False  # once
            self._source._dataset.on_epoch_end()


class PyDatasetBatches(_Batches):
    """A `keras.utils.PyDataset`: tower k of step s takes batch `s * N + k` of
    the pass. Keras's own reader reads it: with `workers > 1`, that many
    threads (processes, with `use_multiprocessing`) read up to
    `max_queue_size` batches ahead, exactly as in stock Keras's fit.

    A pass is `len(ds)` batches, `ceil(len(ds) / N)` steps, between
    `on_epoch_begin()` and `on_epoch_end()`, as stock Keras calls them:
    evaluate's and predict's pass ends with its last batch read (of their
    `steps`), fit's once its epoch's steps are done, unless `stop_training`
    broke the epoch off (`epoch_ends`); with `steps_per_epoch`, fit's
    epochs call both, not the passes (`epoch_begins`). `shuffle` (fit's)
    permutes the batch indices every pass: where Keras's seed is set
    (`keras.utils.set_random_seed`), with Python's `random` as stock Keras
    does (`keras_order.PythonPassOrder`: one tower reads stock Keras's
    order, N towers deal it out); else replayably from a seed drawn from
    numpy's generator.

    The calls stock Keras 3.15 makes besides the passes are made alike (see
    `read_by`): on TensorFlow, batches 0 and 1 read for the spec
    (`first_batches`); on JAX, the build batch read in a pass of its own
    (`first_batch`); and, when fit or evaluate begins (`reading`), one
    `on_epoch_end()` (Keras's `EpochIterator.reset()`).

    Examples:
        >>> from kerastower.inputs.python_sources import PyDatasetBatches
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
        # Keras never shuffles a PyDataset without end.
        self.shuffles = bool(shuffle) and not self.never_ends
        self.method = None  # which call reads it ("fit", "evaluate", "predict"): `read_by`
        self.python_order = None  # a keras_order.PythonPassOrder, where Keras's seed is set
        self._seed = None
        self._agreed = None  # what `shuffle_seed` handed out, until set back
        self._build_pass_open = False
        self.steps_limit = None  # the steps evaluate or predict take (`read_by`)
        self._epoch_open = False  # fit's epoch called on_epoch_begin (`epoch_begins`)
        self._pass_read = False  # fit's pass of this epoch was read to its end
        if self.shuffles:
            if _compat.keras_random_seed() is not None:
                self.python_order = keras_order.PythonPassOrder(self.length)
            else:
                self._seed = int(np.random.randint(2**31 - 1))

    @property
    def shuffle_seed(self):
        """What decides the order, for several processes to agree on (the
        chief's wins; None without shuffle): the seed of the seeded order,
        or, where stock Keras's order is followed, Python's generator state."""
        if not self.shuffles:
            return None
        if self.python_order is None:
            return self._seed
        state = random.getstate()
        self._agreed = {"python_random": [state[0], list(state[1]), state[2]]}
        return self._agreed

    @shuffle_seed.setter
    def shuffle_seed(self, value):
        if not self.shuffles or value is self._agreed:
            return  # one process: its own
        if isinstance(value, dict):
            version, internal, gauss = value["python_random"]
            state = (version, tuple(internal), gauss)
            # The chief draws from the copy too, and its generator follows it.
            self.python_order = keras_order.PythonPassOrder(
                self.length, chiefs_state=state, moves_global=state == random.getstate())
        else:
            self.python_order, self._seed = None, int(value)

    def steps(self, num_towers):
        """Steps in one pass, or None for a PyDataset without end."""
        return None if self.never_ends else -(-self.length // num_towers)

    def _check_not_empty(self):
        if self.length == 0:
            raise InputSourceError(f"The input ({self.kind}) is empty: its length is 0.")

    def first_batches(self, count=1):
        """Up to `count` first batches, in index order, read as stock
        Keras's TensorFlow adapter reads them for the dataset's spec: no
        hook is called, and the passes read them again."""
        self._check_not_empty()
        count = count if self.never_ends else min(count, self.length)
        return [_standardized_batch(self._dataset[i], i) for i in range(count)]

    def first_batch(self):
        """The batch the model is built from, read as stock Keras-JAX's fit
        and evaluate read it: `on_epoch_begin()`, then the pass's first
        batch (fit's shuffle draws its order), read ahead by one off the
        CPU; the pass's `on_epoch_end()` comes when the run begins
        (`reading`)."""
        self._check_not_empty()
        self._dataset.on_epoch_begin()
        self._build_pass_open = True
        order = self.python_order.peek() if self.python_order is not None else None
        count = keras_order.jax_build_batches()
        if not self.never_ends:
            count = min(count, self.length)
        batches = [self._dataset[i if order is None else order[i]] for i in range(count)]
        return _standardized_batch(batches[0], 0, ragged_sparse.for_jax)

    @contextlib.contextmanager
    def reading(self):
        """The context fit, evaluate or predict reads the dataset in. When
        it begins, fit and evaluate call `on_epoch_end()` once, as stock
        Keras's `EpochIterator.reset()` does after building (predict too,
        on JAX, where its build read a pass)."""
        if self.method in ("fit", "evaluate") or self._build_pass_open:
            self._build_pass_open = False
            self._dataset.on_epoch_end()
        yield

    def _order(self, pass_index):
        if self.never_ends:
            return None
        if not self.shuffles:
            return range(self.length)
        if self.python_order is not None:
            return self.python_order(pass_index)
        return np.random.default_rng([self._seed, pass_index]).permutation(self.length).tolist()

    def _pass(self, pass_index, skip=0, limit=None, hooks=True):
        """One pass's batches from position `skip` on; it ends, as far as
        the hooks go, at batch `limit` (the steps evaluate or predict take)
        or its last. `hooks` False: fit's epochs call them (`epoch_begins`);
        fit's pass, one an epoch, ends with its epoch (`epoch_ends`)."""
        # As in stock Keras, the dataset's on_epoch_begin() runs before the
        # pass's shuffle is drawn (it may draw from Python's `random` too).
        if hooks:
            self._dataset.on_epoch_begin()
        self._pass_read = False
        # Read by Keras's own PyDataset reader (its worker threads or
        # processes and queue), given the pass's batches in our order.
        this_pass = _PassOfDataset(self, self._order(pass_index), skip)
        adapter = _compat.py_dataset_adapter(this_pass)
        adapter.on_epoch_begin()
        last = this_pass.num_batches
        if limit is not None:
            last = limit - skip if last is None else min(last, limit - skip)
        last = None if last is None else last - 1
        batches = iter(adapter.get_numpy_iterator())
        try:
            for position in itertools.count():
                batch = next(batches, _END)
                if batch is _END:
                    break
                if position == last and hooks:
                    self._pass_read = self.method == "fit"
                    this_pass.complete = not self._pass_read
                    adapter.on_epoch_end()
                yield batch
        finally:
            # A pass stopped early stops Keras's reader; the dataset's own
            # on_epoch_end waits for a pass that reached its end.
            adapter.on_epoch_end()

    def raw_pass(self, num_towers, pass_index=0, skip_steps=0):
        """One pass's steps of (number, item) pairs, from step `skip_steps`
        on: `on_epoch_begin()` before its first batch is read, and
        `on_epoch_end()` once its last one was (the last of the steps
        evaluate or predict take; fit's when its epoch ends)."""
        skip = skip_steps * num_towers
        limit = None if self.steps_limit is None else self.steps_limit * num_towers
        return numbered_steps(self._pass(pass_index, skip, limit), num_towers, first_number=skip)

    def raw_endless(self, num_towers, skip_steps=0):
        """Pass after pass, less the first `skip_steps` steps (not read).
        Read by fit (with `steps_per_epoch`), the hooks follow its epochs, as
        in stock Keras (`epoch_begins`), not the passes."""
        if self.length == 0:
            return iter(())
        first_pass = 0
        if not self.never_ends:
            first_pass, skip_steps = divmod(skip_steps, self.steps(num_towers))
        hooks = self.method != "fit"

        def numbered(pass_index, skip_steps=0):
            skip = skip_steps * num_towers
            return numbered_steps(self._pass(pass_index, skip, hooks=hooks), num_towers,
                                  first_number=skip)

        return itertools.chain(
            numbered(first_pass, skip_steps),
            itertools.chain.from_iterable(numbered(p) for p in itertools.count(first_pass + 1)))

    def epoch_begins(self):
        """fit's epoch with `steps_per_epoch` began (after the callbacks'
        `on_epoch_begin`): the dataset's `on_epoch_begin()` runs now, on the
        loop's thread, as stock Keras calls it when the epoch's iteration
        starts; not when a batch is read, which a pipeline may do ahead of
        the epoch."""
        self._epoch_open = True
        self._dataset.on_epoch_begin()

    def epoch_ends(self, completed):
        """fit's epoch ended: `on_epoch_end()` where it ran all its steps,
        its pass read to the end or its `steps_per_epoch` done, and
        `completed` (stock Keras skips it for an epoch that `stop_training`
        broke off, at its last step too)."""
        if completed and (self._epoch_open or self._pass_read):
            self._dataset.on_epoch_end()
        self._epoch_open = self._pass_read = False


_END = object()


def _standardized_batch(batch, number, composite_leaf=None):
    # A bare array is `(x,)`, as Keras's reader hands it on.
    return standardized((batch,) if isinstance(batch, np.ndarray) else batch, number, composite_leaf)


def _pydataset_batches(source):
    """The `PyDatasetBatches` `source` reads (itself, or the TensorFlow
    source holding it), else None."""
    batches = getattr(source, "source", source)
    return batches if isinstance(batches, PyDatasetBatches) else None


def read_by(source, method, steps=None):
    """Tells the PyDataset `source` reads, if any, which call reads it
    ("fit", "evaluate", "predict") and how many steps it takes (None: a
    pass): stock Keras calls its hooks after building for fit and evaluate
    only (`PyDatasetBatches.reading`), and ends evaluate's and predict's
    pass where their steps end."""
    batches = _pydataset_batches(source)
    if batches is not None:
        batches.method = method
        batches.steps_limit = None if method == "fit" else steps


def epoch_begins(source):
    """fit's epoch with `steps_per_epoch` began: see
    `PyDatasetBatches.epoch_begins` (without it, the passes call the hooks)."""
    batches = _pydataset_batches(source)
    if batches is not None:
        batches.epoch_begins()


def epoch_ends(source, completed):
    """fit's epoch ended, not broken off where `completed`: see
    `PyDatasetBatches.epoch_ends`."""
    batches = _pydataset_batches(source)
    if batches is not None:
        batches.epoch_ends(completed)


def reading(source):
    """The context a run reads `source` in: a PyDataset's (see
    `PyDatasetBatches.reading`); else nothing."""
    batches = _pydataset_batches(source)
    return contextlib.nullcontext() if batches is None else batches.reading()
