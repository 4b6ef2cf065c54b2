"""Which batch each tower takes: tower k of step s takes batch `s * N + k`.

Holds the dealing of a source's batches to N towers, the same on every
backend: `numbered_steps` cuts the batches into steps of N, `deal` and
`joined` make each step the towers' batches (`one_step`: joined, as one
tower, when only their numbers of examples differ), `TowerDealer` hands
each tower its part when every tower reads a pipeline of its own, and
`standardized` makes one batch what Keras hands the step. Nothing is taken
before its step is asked for. How a source is read (in passes, resumed,
read ahead) is `python_sources.py`'s.

This module imports neither TensorFlow nor JAX (ragged_sparse.py touches
them only for a batch that holds their ragged or sparse tensors).

Examples:
    >>> from kerastower.inputs.dealing import deal
    >>> steps = deal((np.full((2, 1), i, "float32") for i in range(5)), num_towers=2)
    >>> [[b[0, 0].item() for b in step] for step in steps]
    [[0.0, 1.0], [2.0, 3.0], [4.0]]
"""

import collections
import collections.abc
import itertools
import threading

import keras
import numpy as np

from kerastower.errors import DataMismatchError
from kerastower.errors import InputSourceError
from kerastower.inputs import ragged_sparse

__all__ = ["standardized", "one_step", "numbered_steps", "failed_batch",
           "mark_failed_batch", "batch_words", "joined", "deal",
           "TowerDealer"]


def _as_array(leaf, number, composite_leaf):
    if not isinstance(leaf, np.ndarray) and ragged_sparse.is_composite(leaf):
        if composite_leaf is None:
            raise InputSourceError(
                f"Batch {number} of the input holds a {type(leaf).__name__}. On TensorFlow, "
                "kerastower feeds ragged and sparse tensors from arrays (fit(x=ragged, ...)) "
                "and tf.data.Datasets, not from Python generators, iterables or PyDatasets: "
                "pass the whole arrays, or a tf.data.Dataset (e.g. "
                "tf.data.Dataset.from_generator with a tf.RaggedTensorSpec or "
                "tf.SparseTensorSpec in its output_signature).")
        return composite_leaf(leaf)
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


def standardized(item, number, composite_leaf=None):
    """One batch as Keras hands it to the step: `x` (as the source gave it),
    `(x,)`, `(x, y)` or `(x, y, sample_weight)`, with numpy leaves (tf
    tensors and other array-likes converted).

    A ragged or sparse leaf becomes `composite_leaf(leaf)` where the
    backend's towers take one from a Python source (JAX's,
    `ragged_sparse.for_jax`: padded, or a BCOO); with None it is refused,
    as on TensorFlow, where only arrays and tf.data bring one to the towers."""
    if isinstance(item, list):
        item = tuple(item)
    bare = not isinstance(item, tuple)
    if bare:
        item = (item,)
    if not 1 <= len(item) <= 3:
        raise InputSourceError(
            f"Batch {number} of the input is a tuple of {len(item)} elements; a batch is "
            "x, (x,), (x, y) or (x, y, sample_weight).")
    batch = keras.tree.map_structure(lambda leaf: _as_array(leaf, number, composite_leaf), item)
    if not keras.tree.flatten(batch):
        raise InputSourceError(f"Batch {number} of the input holds no array: {item!r}.")
    lengths = {a.shape[0] for a in keras.tree.flatten(batch)}
    if len(lengths) > 1:
        raise DataMismatchError(
            f"In batch {number} of the input, x, y and sample_weight must have the same "
            f"number of examples; got {sorted(lengths)}.")
    # A bare x stays bare, as Keras hands it to the step.
    return batch[0] if bare else batch


def _signature(batch):
    return (keras.tree.map_structure(lambda _: None, batch),
            [(a.shape[1:], a.dtype) for a in keras.tree.flatten(batch)])


def one_step(batches, first_number, num_towers=None):
    """The batches of one step as the towers take them: as they are when they
    have one shape; joined, as one tower, when only their numbers of examples
    differ; a DataMismatchError when they cannot form one step. Ragged and
    sparse batches are made to fit together (`ragged_sparse.for_towers`,
    `num_towers`: the run's towers, by default the step's batches)."""
    composite = ragged_sparse.has_composite(batches)
    if composite:
        # Ragged rows padded to the step's longest: the towers share one
        # shape, as the batch they join would have.
        batches = ragged_sparse.for_towers(batches, num_towers or len(batches))
    if all(_signature(b) == _signature(batches[0]) for b in batches[1:]):
        sizes = {keras.tree.flatten(b)[0].shape[0] for b in batches}
        if len(sizes) == 1:
            return batches
        return [keras.tree.map_structure(lambda *parts: np.concatenate(parts), *batches)]
    raise DataMismatchError(
        f"Batches {first_number} to {first_number + len(batches) - 1} of the input are "
        "one step's (one per tower) but do not fit together: "
        + "; ".join(f"batch {first_number + i}: {keras.tree.map_structure(np.shape, b)}, dtypes "
                    f"{[str(a.dtype) for a in keras.tree.flatten(b)]}"
                    for i, b in enumerate(batches))
        + ". The towers of one step need the same structure, dtypes and shapes "
        "(except the number of examples).")


class _Step(list):
    """One step's (batch number, item) pairs, knowing the run's number of
    towers (a pass's last step may hold fewer batches)."""

    num_towers = None


_BATCH = "_kerastower_failed_batch"


def failed_batch(error):
    """(batch number in the pass, towers, the source's own index of it or
    None) of the batch whose reading raised `error`, as `numbered_steps`
    marked it, or None: tower k of step s (both counted from 0 in the pass)
    takes batch `s * towers + k`; a shuffled PyDataset's batch of another
    index."""
    return getattr(error, _BATCH, None)


def batch_words(batch):
    """`failed_batch`'s (number, towers, index) in words."""
    number, towers, index = batch
    return (f"making batch {number} of the pass, counted from 0"
            + ("" if index is None else f" (the source's index {index}: fit's shuffle)")
            + f": tower {number % towers}'s batch of step {number // towers + 1} of the pass, "
            f"on {towers} tower(s)")


def mark_failed_batch(error, number, num_towers=None, index=None):
    """Marks `error` as raised making batch `number` of the pass (on
    `num_towers` towers, where known; `index`: the source's own index of
    that batch, where it differs); see `failed_batch`."""
    try:
        setattr(error, _BATCH, (number, num_towers, index))
    except AttributeError:  # an exception type that holds no attributes
        pass


def numbered_steps(items, num_towers, first_number=0):
    """Steps of up to `num_towers` consecutive items, each a list of
    (batch number, item), taking no item before its step is asked for.

    An exception the source raises making an item is marked with that
    item's number (`failed_batch`): a step's items are read in one go, so
    the tower that asked first is not always the one whose batch failed."""
    items = iter(items)
    for number in itertools.count(first_number, num_towers):
        step = _Step()
        for index in range(number, number + num_towers):
            try:
                item = next(items)
            except StopIteration:
                break
            except Exception as error:  # the source's own: marked, then raised on
                # A source that reads ahead (a PyDataset's reader) marked
                # the batch it made itself (`mark_failed_batch`).
                marked = failed_batch(error) or (index, None, None)
                mark_failed_batch(error, marked[0], num_towers, marked[2])
                raise
            step.append((index, item))
        if not step:
            return
        step.num_towers = num_towers
        yield step


def joined(step):
    """A step of (number, item) pairs as the JAX towers take it (`one_step`)."""
    return one_step([standardized(item, number, ragged_sparse.for_jax) for number, item in step],
                    step[0][0],
                    getattr(step, "num_towers", None))


def deal(items, num_towers, first_number=0):
    """Steps of up to `num_towers` consecutive batches from `items`, taking
    no item before its step runs; batches of one step that differ only in
    their number of examples are joined (`one_step`)."""
    return map(joined, numbered_steps(items, num_towers, first_number))


class TowerDealer:
    """Steps (an iterable, or a function giving one) dealt out to towers
    that each read their own pipeline: `take(k)` is tower k's part of its
    next step, `(batch number, item)`; `(None, None)` when that step is
    short of tower k (a pass's last step); None once the steps end.

    Towers may ask in any order (TensorFlow runs their pipelines side by
    side); the steps are still read in order, one at a time, and tower k
    of a step gets its k-th batch. Thread-safe.

    Examples:
        >>> from kerastower.inputs.dealing import TowerDealer, numbered_steps
        >>> dealer = TowerDealer(numbered_steps("abc", num_towers=2), num_towers=2)
        >>> [dealer.take(1), dealer.take(0), dealer.take(0), dealer.take(1)]
        [(1, 'b'), (0, 'a'), (2, 'c'), (None, None)]
        >>> dealer.take(1) is None
        True
    """

    def __init__(self, steps, num_towers):
        # A callable is called when a tower first asks (a PyDataset's
        # on_epoch_begin runs when its pass starts, not when it is planned).
        self._steps = steps
        self._queues = [collections.deque() for _ in range(num_towers)]
        self._lock = threading.Lock()
        self._ended = False

    def take(self, tower):
        with self._lock:
            if callable(self._steps):
                self._steps = iter(self._steps())
            elif not isinstance(self._steps, collections.abc.Iterator):
                self._steps = iter(self._steps)
            queue = self._queues[tower]
            while not queue and not self._ended:
                step = next(self._steps, None)
                self._ended = step is None
                if step is not None:
                    for index, batches in enumerate(self._queues):
                        batches.append(step[index] if index < len(step) else (None, None))
            return queue.popleft() if queue else None
