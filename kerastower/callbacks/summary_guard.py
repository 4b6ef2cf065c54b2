"""`tf.summary` for Keras's TensorBoard callback that stops quietly after
its first failed write.

The writers `GuardedSummary` makes and the summaries it writes stop after
that first failure (which `WriteFailures` warns about once), and a writer
whose flush failed still gives the default-writer slot back to the one
before it. TensorFlow only: the JAX path never imports this module.
"""

import tensorflow as tf

from kerastower.callbacks.write_guard import write_errors

__all__ = ["GuardedSummary"]


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
        except write_errors() as error:
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
            except write_errors():
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
            except write_errors() as error:
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
        except write_errors() as error:
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
        except write_errors() as error:
            self._guarded._failures.failed(error, self._guarded._logdir)
            self._entered.__exit__(*exc_info)  # its writer is closed now: no flush
        return False
