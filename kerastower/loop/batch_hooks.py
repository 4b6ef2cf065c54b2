"""Which of an epoch's steps the callbacks' batch hooks are called for.

Every step, as Keras does, unless the only callback with a batch hook is
kerastower's `ProgressBar` (fit's default with `verbose=1` or 2): a bar
draws a step at most once every `interval` seconds (Keras's `Progbar`), and
from Keras 3.15 shows the last logs it was handed, so handing it only the
steps it may draw changes nothing it shows, while each step handed costs
the loop Keras's thread hand-off of the step's logs (about 0.1 ms a step
of a small model on JAX, against a 0.4 ms step). The epoch's last step is
always handed: the bar's count ends there. Keras 3.10-3.14's bar averages
the values of the steps handed: it gets every step.

Examples:
    >>> seen = []
    >>> class Every(keras.callbacks.Callback):
    ...     def on_train_batch_end(self, batch, logs=None):
    ...         seen.append(batch)
    >>> inputs = keras.Input((3,))
    >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> _ = model.fit(np.ones((16, 3)), np.ones((16, 1)), batch_size=4, verbose=0,
    ...               callbacks=[Every()])
    >>> seen   # a callback of the user's own: every step
    [0, 1, 2, 3]
"""

import keras

__all__ = ["BatchHooks", "batch_hooks", "progress_bar_steps"]


class BatchHooks:
    """The callbacks' `on_train_batch_begin`/`on_train_batch_end` over one epoch.

    Args:
        callbacks: the run's CallbackList, or None for no batch hook at all.
        shows: None (every step), or `shows(step)`: whether the only
            callback with batch hooks, a progress bar, may draw `step`;
            only those steps, and the epoch's last, are handed to
            `on_train_batch_end` (and none to `on_train_batch_begin`, which
            a bar does not have).
    """

    def __init__(self, callbacks, shows=None):
        self.callbacks = callbacks
        self.shows = shows
        self._unshown = None  # (step, logs) of the last step not handed to the hooks

    def begin(self, step):
        if self.callbacks is not None and self.shows is None:
            self.callbacks.on_train_batch_begin(step)

    def end(self, step, logs):
        if self.callbacks is None:
            return
        if self.shows is None or self.shows(step):
            self._unshown = None
            self.callbacks.on_train_batch_end(step, logs)
        else:
            self._unshown = (step, logs)

    def epoch_end(self):
        """Hands the epoch's last step to the hooks where it was not."""
        if self._unshown is not None:
            step, logs = self._unshown
            self._unshown = None
            self.callbacks.on_train_batch_end(step, logs)


def batch_hooks(callbacks, hooks):
    """`Iteration.batch_hooks()`'s answer as a `BatchHooks` over
    `callbacks`: True is every step, False none."""
    if isinstance(hooks, BatchHooks):
        return hooks
    return BatchHooks(callbacks if hooks else None)


def progress_bar_steps(callbacks, bar_type, has_batch_hooks):
    """The `shows` of `callbacks`' only batch-hooked callback where it is a
    `bar_type` (exactly: a subclass may read every step) in Keras's own
    CallbackList, showing each metric's last value (an averaging bar, as
    Keras 3.10-3.14's, needs every step); else None."""
    if type(callbacks) is not keras.callbacks.CallbackList:
        return None
    hooked = [c for c in callbacks.callbacks if has_batch_hooks(c)]
    if len(hooked) != 1 or type(hooked[0]) is not bar_type or not hooked[0].shows_last_values():
        return None
    return hooked[0].shows
