"""The order stock Keras's `fit` reads arrays in, followed where it is known.

`keras.utils.set_random_seed(s)` makes stock Keras's `fit(x, y)` read the
arrays in an order fixed by the seed: on TensorFlow, its array adapter
shuffles the row indices with `tf.random.shuffle` inside its tf.data
pipeline (`shuffle=True`: the whole pass; `"batch"`: within each batch);
on JAX, it draws them from numpy's global generator, one permutation each
time an epoch's iterator starts (and one more when fit first reads a batch
to build the model), `NumpyPassOrder`.
A user who switches to kerastower with the same seed must get the same
numbers on one tower, so where that seed was set, each pass's order is
the one Keras's own pipeline gives, read
from that pipeline (the indices are its only input). N towers read the
order Keras gives one device with their joined batch (the per-tower
batch x N), so they equal one device on the joined batches.

Several processes read the chief's order: whether to follow Keras is the
chief's choice (its seed), on JAX every process draws from its own copy
of the chief's numpy generator, taken when fit begins (a callback's draw
from numpy on one process cannot make them part; the chief's global
generator is then set to where the copy is, the others' stay untouched),
and on TensorFlow every process takes the order the chief's pipeline
gives. Without the seed the passes follow
`ArrayRows`'s own seeded order.

Measured with Keras 3.15 on TensorFlow 2.21: with the seed set, stock
Keras's pipeline gives every epoch the same order (a new iterator of one
pipeline per epoch replays its seeded shuffle); this module gives the same.

    >>> from kerastower.inputs.keras_order import KerasPassOrder
    >>> keras.utils.set_random_seed(0)
    >>> order = KerasPassOrder(length=10, joined_batch=4, shuffle=True)
    >>> sorted(order(0).tolist()) == list(range(10))
    True
"""

import random
import threading

import numpy as np

from kerastower import _compat

__all__ = ["KerasPassOrder", "NumpyPassOrder", "PythonPassOrder", "follow_keras", "order_kind",
           "jax_build_batches"]


class KerasPassOrder:
    """Pass p's order: the rows Keras's own array pipeline reads in its
    p-th iteration (one iteration per epoch, as Keras's fit makes), for
    `length` examples in batches of `joined_batch`.

    Read here, when fit makes its source, on the calling thread: with the
    seed set, the pipeline gives every iteration the same order (Keras 3.15,
    TensorFlow 2.21), which two readings confirm; the towers' pipelines
    then only look it up (reading a tf.data pipeline from inside another's
    threads is avoided). Should a later Keras reshuffle per iteration, the
    passes are read one by one, on demand, instead."""

    def __init__(self, length, joined_batch, shuffle):
        self.key = (int(length), int(joined_batch), shuffle)
        self._batches = _compat.keras_array_batches(int(length), int(joined_batch), shuffle)
        first, second = self._read(), self._read()
        self._same_every_pass = bool(np.array_equal(first, second))
        self._kept = {0: first, 1: second}
        self._read_passes = 2
        # Only where Keras reshuffles: the towers' pipelines ask from tf.data's threads.
        self._lock = threading.Lock()

    @classmethod
    def for_run(cls, rows, joined_batch, strategy):
        """The order of `rows`'s passes in a run of `strategy`: over several
        processes, the chief's (`as_the_chiefs`)."""
        order = cls(rows.length, joined_batch, rows.shuffle)
        return order if strategy.single_process else order.as_the_chiefs(strategy)

    def _read(self):
        # No batch (arrays of 0 examples): an empty order, for fit to warn that it trained nothing.
        return np.concatenate([np.asarray(batch) for batch in self._batches]
                              or [np.zeros(0, np.int64)]).astype(np.int64)

    def as_the_chiefs(self, strategy):
        """This order made the chief's on every process of `strategy` (a
        collective: every process calls it); None where the chief's pipeline
        reshuffles every pass, which one broadcast cannot carry: the seeded
        order then."""
        chiefs = strategy.broadcast_object(
            [self._same_every_pass, self._kept[0].tolist()] if strategy.is_chief else None)
        same_every_pass, first = chiefs
        if not same_every_pass:
            return None
        self._same_every_pass = True
        self._kept = {0: np.asarray(first, np.int64)}
        return self

    def __call__(self, pass_index):
        if self._same_every_pass:
            return self._kept[0]
        with self._lock:
            if pass_index not in self._kept:
                if pass_index < self._read_passes:  # an earlier pass: replay from the first
                    self._read_passes = 0
                while self._read_passes <= pass_index:
                    self._kept = {k: v for k, v in self._kept.items() if k == self._read_passes - 1}
                    self._kept[self._read_passes] = self._read()
                    self._read_passes += 1
            return self._kept[pass_index]


class NumpyPassOrder:
    """Stock Keras-JAX's order: each pass draws from numpy's global
    generator what Keras's array iterator draws when an epoch starts
    (`shuffle=True`: a permutation of the rows; `"batch"`: one of each
    batch's rows, batch after batch), pass after pass, so numpy's generator
    also ends where stock Keras leaves it. `peek` draws what Keras's
    iterator draws for the one batch its fit reads to build the model.

    A pass asked for again replays the draws from the generator's state when
    the order was made (fit's start); a run resumed in a new process that
    seeded numpy alike draws its passes as the first run did."""

    def __init__(self, length, joined_batch, shuffle, chiefs_copy=None, is_chief=True):
        self.key = (int(length), int(joined_batch), shuffle)
        # Numpy's global generator; over several processes, a copy of the
        # chief's, which every process draws from alike.
        self._generator = np.random if chiefs_copy is None else chiefs_copy
        self._shared = chiefs_copy is not None
        self._moves_global = self._shared and is_chief
        self._peeked = False
        self._drawn = -1      # the last pass drawn from the global generator
        self._kept = {}
        self._states = {}     # pass -> the generator's state before its draw

    @classmethod
    def for_run(cls, rows, joined_batch, strategy):
        """The order of `rows`'s passes in a run of `strategy`: over several
        processes, drawn from a copy of the chief's generator (a collective)."""
        chiefs_copy = None
        if not strategy.single_process:
            chiefs_copy = np.random.RandomState()
            chiefs_copy.set_state(strategy.broadcast_object(
                np.random.get_state() if strategy.is_chief else None))
        return cls(rows.length, joined_batch, rows.shuffle, chiefs_copy, strategy.is_chief)

    def _draw(self, generator, first_batches=None):
        length, batch, shuffle = self.key
        if shuffle != "batch":
            return generator.permutation(length).astype(np.int64)
        starts = range(0, length, batch)
        if first_batches is not None:
            starts = starts[:first_batches]
        return np.concatenate([generator.permutation(min(start + batch, length) - start) + start
                               for start in starts]).astype(np.int64)

    def peek(self):
        """Draws what Keras's fit draws for the batch it builds the model
        from: one batch's worth, two where Keras-JAX reads one batch ahead
        (any device but the CPU)."""
        if self._shared:
            return  # drawn with the first pass on every process (_peek_once)
        self._peek_once()

    def _peek_once(self):
        if not self._peeked and self._drawn == -1:
            self._draw(self._generator, first_batches=jax_build_batches())
            self._peeked = True

    def __call__(self, pass_index):
        if pass_index in self._kept:
            return self._kept[pass_index]
        if pass_index in self._states:  # an earlier pass: replayed from its state
            replay = np.random.RandomState()
            replay.set_state(self._states[pass_index])
            return self._draw(replay)
        if self._shared:
            # Whether a process's fit built its model (and so peeked) is
            # its own: every process draws the peek before the first pass.
            self._peek_once()
        while self._drawn < pass_index:
            self._states[self._drawn + 1] = self._generator.get_state()
            order = self._draw(self._generator)
            self._drawn += 1
            self._kept = {self._drawn: order}
        if self._moves_global:  # the chief's generator ends where stock Keras leaves it
            np.random.set_state(self._generator.get_state())
        return self._kept[pass_index]


def jax_build_batches():
    """How many batches stock Keras-JAX's fit reads to build the model: one
    on the CPU, two elsewhere (it reads one batch ahead there)."""
    import jax  # only asked on JAX

    return 1 if jax.default_backend() == "cpu" else 2


class PythonPassOrder:
    """Stock Keras's order of a shuffled `keras.utils.PyDataset`'s batches:
    Keras's PyDataset reader shuffles the batch indices with Python's
    `random.shuffle` each time a pass begins (on JAX also for the pass its
    fit reads the build batch from, `peek`), so pass p takes the p-th
    shuffle drawn since fit began, and Python's generator ends where stock
    Keras leaves it.

    Drawn from Python's global generator, or, over several processes, from
    a copy of the chief's (`chiefs_state`, taken when fit began): every
    process then draws alike, and the chief's global generator is set to
    where the copy is after each draw (`moves_global`). A pass asked for
    again replays its draw from the generator's state before it; a resumed
    run that seeded Python alike draws the passes before its own, as the
    first run did.

    Examples:
        >>> import random
        >>> from kerastower.inputs.keras_order import PythonPassOrder
        >>> random.seed(3)
        >>> stock = list(range(5)); random.shuffle(stock)
        >>> random.seed(3)
        >>> PythonPassOrder(5)(0) == stock
        True
    """

    def __init__(self, length, chiefs_state=None, moves_global=False):
        self.length = int(length)
        if chiefs_state is None:
            self._generator = random
        else:
            self._generator = random.Random()
            self._generator.setstate(chiefs_state)
        self._moves_global = chiefs_state is not None and moves_global
        self._peeked = None
        self._drawn = -1      # the last pass drawn
        self._kept = {}
        self._states = {}     # pass -> the generator's state before its draw

    def _draw(self, generator):
        indices = list(range(self.length))
        generator.shuffle(indices)
        if self._moves_global and generator is self._generator:
            random.setstate(generator.getstate())
        return indices

    def peek(self):
        """The order of the pass stock Keras-JAX's fit reads its build
        batch from: drawn once, before the first pass."""
        if self._peeked is None:
            self._peeked = self._draw(self._generator) if self._drawn == -1 else self(0)
        return self._peeked

    def __call__(self, pass_index):
        if pass_index in self._kept:
            return self._kept[pass_index]
        if pass_index in self._states:  # an earlier pass: replayed from its state
            replay = random.Random()
            replay.setstate(self._states[pass_index])
            return self._draw(replay)
        while self._drawn < pass_index:
            self._states[self._drawn + 1] = self._generator.getstate()
            order = self._draw(self._generator)
            self._drawn += 1
            self._kept = {self._drawn: order}
        return self._kept[pass_index]


def follow_keras(rows, strategy, order):
    """Sets `rows.pass_order` (an `ArrayRows`'s) to stock Keras's order on
    the engine's backend (`order`: `KerasPassOrder` on TensorFlow,
    `NumpyPassOrder` on JAX) where the arrays are shuffled and Keras's seed
    is set (the chief's, over several processes); else to None (the seeded
    order). Made when fit begins, on every process: over several, a
    collective."""
    rows.pass_order = None
    if not rows.shuffle:
        return
    several = not strategy.single_process
    seeded = _compat.keras_random_seed() is not None
    if several:  # one process following Keras and another not would part ways
        seeded = strategy.broadcast_object(seeded if strategy.is_chief else None)
    if seeded:
        rows.pass_order = order.for_run(rows, rows.batch_size * strategy.num_towers, strategy)


def order_kind(rows, backend):
    """What decides the order of `rows`'s passes, as a checkpoint records
    it: "keras-tensorflow" or "keras-jax" (with `shuffle="batch"`, followed
    by the joined batch), "seeded", or None (in order).

    `rows` may also be a shuffled PyDataset's batches (`PyDatasetBatches`,
    or the TensorFlow source holding them): "keras-tensorflow, PyDataset" or
    "keras-jax, PyDataset" where stock Keras's order is followed on
    `backend`, the engine's (on JAX Keras draws one shuffle more, for the
    build), else "seeded"."""
    batches = getattr(rows, "source", rows)
    if hasattr(batches, "python_order"):
        if not getattr(batches, "shuffles", False):
            return None
        if batches.python_order is None:
            return "seeded"
        return f"keras-{backend}, PyDataset"
    if rows is None or not getattr(rows, "shuffle", False):
        return None
    if rows.pass_order is None:
        return "seeded"
    kind = "keras-jax" if isinstance(rows.pass_order, NumpyPassOrder) else "keras-tensorflow"
    length, joined_batch, shuffle = rows.pass_order.key
    # Within batches, the order depends on the joined batch too.
    return f"{kind}, within batches of {joined_batch}" if shuffle == "batch" else kind
