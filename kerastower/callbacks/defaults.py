"""The monitors a run gets by default: `fit(logdir=...)`'s and the progress bar.

Examples:
    >>> from kerastower.callbacks.defaults import with_default_monitors
    >>> monitors = with_default_monitors([], verbose=0, logdir="run")
    >>> [type(c).__name__ for c in monitors[::2]], monitors[1].log_dir   # and a TensorBoard
    (['ThroughputTracker', 'JSONWriter'], 'run')
"""

import keras

from kerastower import callbacks as _callbacks
from kerastower.callbacks import monitors
from kerastower.callbacks.base import unwrapped
from kerastower.callbacks.event_scalars import ScalarTensorBoard

__all__ = ["TENSORBOARD_KINDS", "with_default_monitors"]

# Either kind counts as the run's TensorBoard: Keras's (TensorFlow) or the
# scalars-only one kt.callbacks.TensorBoard is on JAX.
TENSORBOARD_KINDS = (keras.callbacks.TensorBoard, ScalarTensorBoard)


def with_default_monitors(callbacks, verbose, logdir):
    """The user's callbacks, then, given a logdir, throughput, TensorBoard
    and stats.json writers, and kerastower's progress bar last."""
    callbacks = list(callbacks or [])
    kinds = tuple(type(unwrapped(cb)) for cb in callbacks)
    if logdir is not None:
        for kind, make in (
            (monitors.ThroughputTracker, monitors.ThroughputTracker),
            (TENSORBOARD_KINDS, lambda: _callbacks.TensorBoard(logdir)),
            (monitors.JSONWriter, lambda: monitors.JSONWriter(logdir)),
        ):
            if not any(issubclass(k, kind) for k in kinds):
                callbacks.append(make())
    if verbose != 0 and not any(issubclass(k, keras.callbacks.ProgbarLogger) for k in kinds):
        # Last, as Keras puts its own: the epoch line shows what the others added.
        callbacks.append(monitors.ProgressBar())
    return callbacks
