"""Monitors that cannot write warn once instead of stopping training.

`WriteFailures` keeps a monitor's first failed write of a run and warns
about it once (a `kt.errors.MonitorWriteWarning` naming the path and the
OS or TensorFlow error). For Keras's TensorBoard, `GuardedSummary`
(summary_guard.py) stands in for `tf.summary`.
"""

import re
import warnings

from kerastower._tf import tf
from kerastower._tf import tf_loaded
from kerastower.errors import MonitorWriteWarning

__all__ = ["write_errors", "WriteFailures", "never_raising_a_write_error"]


def write_errors():
    """What a failed write raises: Python's file calls, and TensorFlow's file
    ops once TensorFlow is in use."""
    return (OSError, tf.errors.OpError) if tf_loaded() else (OSError,)


def _error_text(error):
    """An OS or TensorFlow error in one line, without TF's node names."""
    text = getattr(error, "message", None) or str(error)
    text = re.sub(r"\{\{[^}]*\}\}\s*", "", text.strip().splitlines()[0])
    text = re.sub(r"\s*\[Op:[^\]]*\]( name:.*)?$", "", text)
    return f"{type(error).__name__}: {text}"


class WriteFailures:
    """Warns once, for one monitor and one run, that it cannot write;
    `on_failure()`, if set, is called then."""

    def __init__(self, monitor):
        self.monitor = monitor
        self.error = None
        self.on_failure = None

    def reset(self):
        self.error = None

    def failed(self, error, path):
        if self.error is not None:
            return
        self.error = error
        if self.on_failure is not None:
            self.on_failure()
        warnings.warn(
            f"kerastower: {self.monitor} cannot write {path} ({_error_text(error)}). "
            "Training and checkpoints go on without it, and it will not warn again in "
            "this run. Give logdir a folder that can be written and has free space.",
            MonitorWriteWarning,
            stacklevel=2,
        )


def never_raising_a_write_error(hook):
    """A TensorBoard hook that, instead of raising a write error, reports it
    to the callback's `_failures` (which warns once)."""

    def guarded(self, *args, **kwargs):
        try:
            return hook(self, *args, **kwargs)
        except write_errors() as error:
            self._failures.failed(error, self.log_dir)

    guarded.__name__ = guarded.__qualname__ = hook.__name__
    guarded.__doc__ = hook.__doc__
    return guarded
