"""A Python iterator fed to tf.data from a background thread.

`tf.data.Dataset.from_generator` runs the generator inside tf.data and checks
every item with TensorFlow's structure utilities: on a 2-core machine that
costs about 0.65 ms of CPU per item, taken from the training step. Here a
thread of ours runs the generator ahead into a bounded queue, checking each
item against the signature with numpy, and tf.data only takes finished
arrays out of the queue (one `numpy_function` call per item, about half the
CPU). The generator's own Python work overlaps the step.

Each iterator of the dataset gets its own generator and thread. The thread
is started by a one-item `from_generator` "session" whose generator stays
suspended while the items flow; tf.data closes it when the iterator is
destroyed (or the items end), and closing it stops the thread and closes
the user's generator, as `from_generator` would.

A run does not leave that to the garbage collector, which may keep an
iterator (and so a thread and the user's generator) alive long after fit:
the source's `SourceFeeds.reading()` context, which fit, evaluate and
predict enter, stops every feed of the datasets made inside it when it
ends, failed or not.
"""

import contextlib
import itertools
import queue
import threading
import time
import warnings

import numpy as np

from kerastower._tf import tf
from kerastower.errors import InputSourceError

__all__ = ["feedable", "feed_dataset", "SourceFeeds"]

_POLL_SECONDS = 0.1  # how often a thread waiting on a full queue checks for stop
# How long a run's end waits, for all its feeds together, for items being
# made on demand before it leaves closing their generators to the calls
# that make them.
_CLOSE_WAIT_SECONDS = 5.0


def feedable(signature):
    """Whether items of `signature` can be fed by `feed_dataset`: dense
    numeric or boolean `tf.TensorSpec`s only (others go to from_generator)."""
    return all(
        type(spec) is tf.TensorSpec and (spec.dtype.is_numeric or spec.dtype.is_bool)
        for spec in tf.nest.flatten(signature)
    )


class _Feed:
    """One iterator's generator, run ahead by a thread into a queue of
    `prefetch` items (with `prefetch` 0, run on demand by `take`)."""

    def __init__(self, make_iterator, signature, prefetch, name, on_error):
        self._iterator = iter(make_iterator())
        self._on_error = on_error
        self._signature = signature
        self._specs = tf.nest.flatten(signature)
        self._name = name
        self._count = 0  # items taken from the iterator
        self._stop = threading.Event()
        self._on_demand = threading.Lock()  # held while an item is made by `take`
        self._closed = False
        self._queue = None
        self._end = None  # the (done, error, None) entry, once taken
        if prefetch > 0:
            self._queue = queue.Queue(prefetch)
            threading.Thread(target=self._run, daemon=True, name=f"kerastower-feed-{name}").start()

    def _arrays(self, item):
        self._count += 1
        try:
            values = _flatten_like(self._signature, item)
        except (TypeError, KeyError, ValueError) as error:
            raise InputSourceError(
                f"{self._name} yielded, as item {self._count}, {_describe(item)}; its "
                f"output_signature is {self._signature}. Yield items of that structure."
            ) from error
        arrays = []
        for value, spec in zip(values, self._specs):
            array = np.asarray(value)
            if not spec.shape.is_compatible_with(array.shape):
                raise InputSourceError(
                    f"{self._name} yielded, as item {self._count}, an array of shape "
                    f"{array.shape} where its output_signature has {spec}."
                )
            arrays.append(array.astype(spec.dtype.as_numpy_dtype, copy=False))
        return arrays

    def _next(self):
        """(done, error, arrays) for the next item."""
        try:
            return False, None, self._arrays(next(self._iterator))
        except StopIteration:
            return True, None, None
        except Exception as error:  # noqa: BLE001 - handed to the step that takes it
            good = self._count - 1 if isinstance(error, InputSourceError) else self._count
            self._on_error(error, good)
            return True, error, None

    def _run(self):
        try:
            while not self._stop.is_set():
                entry = self._next()
                while not self._stop.is_set():
                    try:
                        self._queue.put(entry, timeout=_POLL_SECONDS)
                        break
                    except queue.Full:
                        continue
                if entry[0]:
                    return
        finally:
            self._close_iterator()

    def _close_iterator(self):
        # Once: an iterator's close() need not be safe to repeat (a socket).
        if self._closed:
            return
        self._closed = True
        close = getattr(self._iterator, "close", None)
        if close is not None:
            close()

    def _make_on_demand(self):
        with self._on_demand:
            if self._stop.is_set():
                return True, None, None
            entry = self._next()
            if self._stop.is_set():  # stopped while the item was made
                self._close_iterator()
            return entry

    def take(self):
        """The next item's arrays after a False; True and empty arrays at
        the end. Never blocks for good: tf.data may ask again after the end
        (its autotuned prefetch runs ahead) or while the feed is stopping."""
        entry = self._end
        while entry is None:
            if self._queue is None:
                entry = self._make_on_demand()
            elif self._stop.is_set():
                entry = (True, None, None)
            else:
                try:
                    entry = self._queue.get(timeout=_POLL_SECONDS)
                except queue.Empty:
                    continue
            if entry[0]:
                self._end = entry
        done, error, arrays = entry
        if error is not None:
            raise error
        if done:
            return [np.bool_(True)] + [_empty(spec) for spec in self._specs]
        return [np.bool_(False)] + arrays

    def request_stop(self):
        """Asks the feed to end: `take` gives the end from now on, and its
        thread closes the generator once the item it makes is made."""
        self._stop.set()

    def stop(self, deadline=None):
        """Ends the feed (`request_stop`). On demand, the generator is closed
        here, waiting until `deadline` (a `time.monotonic()`; default
        `_CLOSE_WAIT_SECONDS` from now) for an item being made, else by the
        `take` making it: a generator is not closed mid-item."""
        self.request_stop()
        if self._queue is not None:
            return
        if deadline is None:
            deadline = time.monotonic() + _CLOSE_WAIT_SECONDS
        if self._on_demand.acquire(timeout=max(0.0, deadline - time.monotonic())):
            try:
                self._close_iterator()
            finally:
                self._on_demand.release()


class _OpenFeeds:
    """The feeds of one dataset's iterators, by key; once stopped, the
    dataset's later iterators feed nothing."""

    def __init__(self):
        self._lock = threading.Lock()
        self._feeds = {}
        self._keys = itertools.count()
        self._stopped = False

    def open(self, make_feed):
        """A new feed's key, or None when the dataset was stopped."""
        with self._lock:
            if self._stopped:
                return None
            key = next(self._keys)
            self._feeds[key] = make_feed()
            return key

    def get(self, key):
        with self._lock:
            return self._feeds[key]

    def close(self, key):
        with self._lock:
            feed = self._feeds.pop(key, None)
        if feed is not None:
            feed.stop()

    def request_stop(self):
        """Stops the dataset: its later iterators feed nothing, and every
        feed is asked to end; returns them (`_Feed.stop` finishes each)."""
        with self._lock:
            self._stopped = True
            # Kept until their iterators end: a stopped feed gives the end.
            feeds = list(self._feeds.values())
        for feed in feeds:
            feed.request_stop()
        return feeds


class SourceFeeds:
    """The feeds of every dataset `feed_dataset` made for one source, so
    that a run stops those it made (`reading`) and no other run's.

    Examples:
        >>> import tensorflow as tf
        >>> from kerastower.inputs.python_feed import SourceFeeds, feed_dataset
        >>> feeds = SourceFeeds()
        >>> def items():
        ...     while True:
        ...         yield np.zeros((2,), "float32")
        >>> with feeds.reading():
        ...     dataset = feed_dataset(items, tf.TensorSpec((None,), tf.float32), 2,
        ...                            "items", lambda error, good: None, feeds)
        ...     next(iter(dataset)).shape.as_list()
        [2]
    """

    def __init__(self):
        self._datasets = []  # the _OpenFeeds of datasets made in runs, in the order made
        self._runs = 0  # the runs reading now (they nest)

    def new_dataset(self):
        """A dataset's feeds; kept for the run reading now (outside any, as
        a spec read before fit, tf.data's own end stops them)."""
        opened = _OpenFeeds()
        if self._runs:
            self._datasets.append(opened)
        return opened

    @contextlib.contextmanager
    def reading(self):
        """A run's context: the feeds of datasets made inside it stop when
        it ends. Runs nest (an evaluate in a callback of fit): the inner one
        stops only its own."""
        first = len(self._datasets)
        self._runs += 1
        try:
            yield
        finally:
            self._runs -= 1
            made = self._datasets[first:]
            del self._datasets[first:]
            _stop_all(made)


def _stop_all(datasets):
    """Stops every feed of `datasets`: all are asked first, then each is
    finished against one deadline, so a run's end waits for slow items
    once, not once per feed. A generator whose close() raises is reported,
    not raised: the run's own outcome (its result, or its error) stands."""
    feeds = [feed for opened in datasets for feed in opened.request_stop()]
    deadline = time.monotonic() + _CLOSE_WAIT_SECONDS
    for feed in feeds:
        try:
            feed.stop(deadline)
        except Exception as error:  # noqa: BLE001 - the user's generator's close()
            warnings.warn(f"kerastower: closing {feed._name} at the end of the run raised "
                          f"{type(error).__name__}: {error}", RuntimeWarning, stacklevel=2)


def _flatten_like(signature, item):
    """`item`'s leaves in tf.nest order, flattened only as deep as
    `signature` (a leaf may be a list, as from_generator allows)."""
    if isinstance(signature, tf.TensorSpec):
        return [item]
    if isinstance(signature, dict):
        return [leaf for key in sorted(signature) for leaf in _flatten_like(signature[key], item[key])]
    if isinstance(signature, (tuple, list)) and isinstance(item, (tuple, list)) and len(item) == len(signature):
        return [leaf for spec, part in zip(signature, item) for leaf in _flatten_like(spec, part)]
    raise TypeError(f"expected {type(signature).__name__} of {len(signature)}")


def _empty(spec):
    return np.zeros([0 if d is None else d for d in spec.shape.as_list()], spec.dtype.as_numpy_dtype)


def _describe(item):
    shapes = tf.nest.map_structure(lambda v: getattr(v, "shape", type(v).__name__), item)
    return f"an item of structure {shapes}"


def feed_dataset(make_iterator, signature, prefetch, name, on_error, source_feeds=None):
    """A dataset of the items of `make_iterator()` (a fresh iterator per
    dataset iterator), run ahead by `prefetch` items in a thread.

    `signature` must be `feedable`. An exception the iterator raises, or an
    item that does not match `signature`, is handed to `on_error(error,
    good items before it)` when met, and fails the get_next that reaches it
    with its text (tf.data passes on only the text). `source_feeds`: the
    source's `SourceFeeds`, whose `reading()` stops this dataset's feeds."""
    specs = tf.nest.flatten(signature)
    feeds = (source_feeds or SourceFeeds()).new_dataset()

    def session():
        key = feeds.open(lambda: _Feed(make_iterator, signature, prefetch, name, on_error))
        if key is None:  # the run that made the dataset has ended
            return
        try:
            yield key
        finally:
            feeds.close(key)

    def take(key):
        return feeds.get(int(key)).take()

    def items(key):
        def one(_):
            flat = tf.numpy_function(take, [key], [tf.bool] + [s.dtype for s in specs])
            for tensor, spec in zip(flat[1:], specs):
                tensor.set_shape(spec.shape)
            return flat[0], tf.nest.pack_sequence_as(signature, flat[1:])

        return (tf.data.Dataset.from_tensors(key).repeat().map(one)
                .take_while(lambda done, _: tf.logical_not(done))
                .map(lambda _, item: item))

    keys_dataset = tf.data.Dataset.from_generator(
        session, output_signature=tf.TensorSpec((), tf.int64))
    return keys_dataset.flat_map(items)
