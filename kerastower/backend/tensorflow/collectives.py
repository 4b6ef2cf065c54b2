"""Counting the collectives a step launches: what synchronises the towers.

Every `TowerStrategy` operation that makes towers (or processes) wait for
each other notes itself here while a step function is traced, once per step
(on tower 0's trace, or in cross-replica code). `collectives_per_step(model)`
then says what one training step and one read of the logs launch:

Examples:
    >>> inputs = keras.Input((3,))
    >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> _ = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0)
    >>> kt.collectives_per_step(model)["step"]
    []

    One tower launches nothing; docs/performance.md lists what N towers launch
    under each strategy.
"""

import contextlib
import threading

from kerastower._tf import tf

__all__ = ["collectives_per_step", "note", "recording"]

_lock = threading.Lock()


class _Record:
    def __init__(self):
        self.phase = "step"
        self.launches = {"step": [], "logs": []}


_active = []  # the record of the step function being traced (towers trace in threads)


@contextlib.contextmanager
def recording(model, mode):
    """Records the collectives of the step function of `mode` being traced
    into `model`'s step cache (replacing those of an earlier trace)."""
    record = _Record()
    with _lock:
        _active.append(record)
    try:
        yield record
    finally:
        with _lock:
            _active.remove(record)
        model.engine.cache.collectives[mode] = record.launches


@contextlib.contextmanager
def phase(name):
    """Collectives noted inside are those of reading the logs (`"logs"`),
    not of each step (`"step"`)."""
    with _lock:
        records = list(_active)
    previous = [r.phase for r in records]
    for r in records:
        r.phase = name
    try:
        yield
    finally:
        for r, p in zip(records, previous):
            r.phase = p


def note(kind, tensors, first_tower=0):
    """Notes one collective launch of `kind` over `tensors` (a count) in the
    step being traced. Each tower traces the step, so only the trace of
    this process's first tower (`first_tower`) or cross-replica code counts."""
    replica = tf.distribute.get_replica_context()
    if replica is not None and tf.distribute.has_strategy():
        index = tf.get_static_value(replica.replica_id_in_sync_group)
        if index is not None and index != first_tower:
            return
    with _lock:
        for record in _active:
            record.launches[record.phase].append((kind, int(tensors)))


def collectives_per_step(model, mode="train"):
    """What one step of `model` launched when last traced.

    Returns a dict: `"step"`, the collectives every step launches, and
    `"logs"`, those launched to read the metrics across towers for the logs
    (where towers span processes, once per epoch or evaluation, not every
    step). Each is a list of `(kind, number of tensors)`, e.g.
    `("all_reduce", 5)`: one batched all-reduce of 5 tensors. Empty lists
    before the step function was first traced, or when nothing synchronises.

    Args:
        model: a `kt.TowerModel` that has run `fit`, `evaluate` or `predict`.
        mode: "train", "test" or "predict".

    Examples:
        >>> with kt.distributed("single"):
        ...     inputs = keras.Input((3,))
        ...     model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        ...     model.compile(optimizer="sgd", loss="mse")
        ...     _ = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0)
        >>> kt.collectives_per_step(model)     # one device: nothing to synchronise
        {'step': [], 'logs': []}
    """
    return model.engine.collectives_per_step(mode)
