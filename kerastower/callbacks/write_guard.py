"""Monitors that cannot write warn once instead of stopping training.

`WriteFailures` keeps a monitor's first failed write of a run and warns
about it once (a `kt.errors.MonitorWriteWarning` naming the path and the
OS or TensorFlow error). For Keras's TensorBoard, `GuardedSummary` stands
in for `tf.summary`: the writers it makes and the summaries it writes stop
quietly after that first failure, and a writer whose flush failed still
gives the default-writer slot back to the one before it.
"""

import re
import warnings

import tensorflow as tf

from kerastower.errors import MonitorWriteWarning

__all__ = ["WRITE_ERRORS", "WriteFailures", "GuardedSummary", "never_raising_a_write_error"]

# What a failed write raises: Python's file calls, and TensorFlow's file ops.
WRITE_ERRORS = (OSError, tf.errors.OpError)


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
        except WRITE_ERRORS as error:
            self._failures.failed(error, self.log_dir)

    guarded.__name__ = guarded.__qualname__ = hook.__name__
    guarded.__doc__ = hook.__doc__
    return guarded


class GuardedSummary:
    """`tf.summary` for one TensorBoard callback: after its first failed
    write, it makes no-op writers and writes nothing."""

    _WRITING = ("scalar", "histogram", "image", "text", "audio", "write", "graph", "trace_export")

    def __init__(self, failures, log_dir):
        self._failures = failures
        self._log_dir = log_dir
        self._writers = []
        failures.on_failure = self._close_writers

    def create_file_writer(self, logdir, *args, **kwargs):
        if self._failures.error is not None:
            return tf.summary.create_noop_writer()
        try:
            writer = tf.summary.create_file_writer(logdir, *args, **kwargs)
        except WRITE_ERRORS as error:
            self._failures.failed(error, logdir)
            return tf.summary.create_noop_writer()
        self._writers.append(writer)
        return _GuardedWriter(writer, self._failures, logdir)

    def _close_writers(self):
        # A closed writer's flush returns at once, so the contexts that made
        # it the default writer can still exit and restore the previous one.
        for writer in self._writers:
            try:
                writer.close()
            except WRITE_ERRORS:
                pass
        self._writers = []

    def __getattr__(self, name):
        attribute = getattr(tf.summary, name)
        if name not in self._WRITING:
            return attribute

        def write(*args, **kwargs):
            if self._failures.error is not None:
                return False
            try:
                return attribute(*args, **kwargs)
            except WRITE_ERRORS as error:
                self._failures.failed(error, self._log_dir)
                return False

        return write


class _GuardedWriter(tf.summary.SummaryWriter):
    """A file writer whose failed flush warns instead of raising."""

    def __init__(self, writer, failures, logdir):
        self._writer = writer
        self._failures = failures
        self._logdir = logdir

    def as_default(self, step=None):
        return _GuardedDefault(self, step)

    def init(self):
        return self._quietly(self._writer.init)

    def flush(self):
        return self._quietly(self._writer.flush)

    def close(self):
        return self._quietly(self._writer.close)

    def _quietly(self, operation):
        if self._failures.error is not None:
            return None
        try:
            return operation()
        except WRITE_ERRORS as error:
            self._failures.failed(error, self._logdir)
            return None


class _GuardedDefault:
    """`writer.as_default(step)` that restores the previous default writer
    even when the flush on exit fails; nothing at all after a failure."""

    def __init__(self, guarded, step):
        self._guarded = guarded
        self._step = step
        self._entered = None

    def __enter__(self):
        if self._guarded._failures.error is None:
            self._entered = self._guarded._writer.as_default(self._step)
            self._entered.__enter__()
        return self._guarded

    def __exit__(self, *exc_info):
        if self._entered is None:
            return False
        try:
            self._entered.__exit__(*exc_info)
        except WRITE_ERRORS as error:
            self._guarded._failures.failed(error, self._guarded._logdir)
            self._entered.__exit__(*exc_info)  # its writer is closed now: no flush
        return False
