"""TensorBoard scalars without TensorFlow: `kt.callbacks.TensorBoard` on JAX.

Keras's TensorBoard callback writes through `tf.summary`, so on the JAX
backend it needs TensorFlow. This one writes the same files with
tensorboard's own record format (`_EventFile`: not its EventFileWriter,
which goes through `tf.io.gfile` and so imports TensorFlow whenever it is
installed; a local folder is what it writes to): `log_dir/train` holds `batch_<name>` at
every global step (the training run's, which `model.loop` shows) and `epoch_<name>` at every
epoch, `log_dir/validation` the epoch's `val_` values as `epoch_<name>`;
the learning rate is `epoch_learning_rate`. It writes scalars only (no
graph, histograms or images). When it cannot write, it warns once and
writes nothing more in that run; training goes on.

Examples:
    >>> import os
    >>> from kerastower.callbacks.event_scalars import ScalarTensorBoard
    >>> inputs = keras.Input((3,))
    >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> _ = model.fit(np.ones((16, 3)), np.ones((16, 1)), batch_size=4, epochs=2,
    ...               verbose=0, callbacks=[ScalarTensorBoard("scalars")])
    >>> os.listdir("scalars")     # read it with `tensorboard --logdir scalars`
    ['train']
"""

import itertools
import os
import socket
import time

import keras
import numpy as np

from kerastower.arguments import integer
from kerastower.callbacks.base import RunAware
from kerastower.callbacks.monitors import _learning_rate
from kerastower.callbacks.write_guard import WriteFailures
from kerastower.callbacks.write_guard import write_errors

__all__ = ["ScalarTensorBoard"]


def _scalars(logs):
    """The logs that are one number each, as floats."""
    found = {}
    for name, value in (logs or {}).items():
        try:
            array = np.asarray(value, dtype="float64")
        except (TypeError, ValueError):
            continue
        if array.size == 1:
            found[name] = float(array.reshape(()))
    return found


class ScalarTensorBoard(RunAware, keras.callbacks.Callback):
    """Writes a run's scalars for TensorBoard, with no TensorFlow.

    Args:
        log_dir: the folder; `train/` and `validation/` go in it.
        update_freq: "batch" (every step), "epoch" (epoch scalars only), or
            an integer n: step scalars after the steps that reach a
            multiple of n.
    """

    chief_only = True

    def __init__(self, log_dir="logs", update_freq="batch"):
        super().__init__()
        if not (isinstance(update_freq, str) and update_freq in ("batch", "epoch")):
            update_freq = integer(update_freq, 'update_freq (or "batch", "epoch")',
                                  "TensorBoard", minimum=1)
        self.log_dir = os.fspath(log_dir)
        self.update_freq = 1 if update_freq == "batch" else update_freq
        self._failures = WriteFailures("TensorBoard")
        self._writers = {}
        self._last_written_step = 0

    def set_model(self, model):
        super().set_model(model)
        self._tower_model = model

    def _step(self):
        # The run's counter, not `self.model`'s: on JAX that would first
        # write the towers' weights into the model's variables.
        run = self.training_run
        loop = run.state if run is not None else getattr(self._tower_model, "loop", None)
        return loop.global_step if loop is not None else 0

    def _write(self, folder, scalars, step):
        if self._failures.error is not None or not scalars:
            return
        from tensorboard.compat.proto import event_pb2
        from tensorboard.compat.proto import summary_pb2

        path = os.path.join(self.log_dir, folder)
        try:
            if folder not in self._writers:
                self._writers[folder] = _EventFile(path)
            summary = summary_pb2.Summary(value=[
                summary_pb2.Summary.Value(tag=tag, simple_value=value)
                for tag, value in sorted(scalars.items())])
            self._writers[folder].add_event(
                event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))
        except write_errors() as error:
            self._failures.failed(error, path)

    def on_train_begin(self, logs=None):
        self._failures.reset()
        self._last_written_step = self._step()

    def on_train_batch_end(self, batch, logs=None):
        if self.update_freq == "epoch":
            return
        step = self._step()
        due = step // self.update_freq > self._last_written_step // self.update_freq
        self._last_written_step = step
        if due:
            self._write("train", {f"batch_{k}": v for k, v in _scalars(logs).items()}, step)

    def on_epoch_end(self, epoch, logs=None):
        scalars = _scalars(logs)
        train = {f"epoch_{k}": v for k, v in scalars.items() if not k.startswith("val_")}
        learning_rate = _learning_rate(self._tower_model)
        if learning_rate is not None and "epoch_learning_rate" not in train:
            train["epoch_learning_rate"] = learning_rate
        self._write("train", train, epoch)
        self._write("validation", {f"epoch_{k[4:]}": v for k, v in scalars.items()
                                   if k.startswith("val_")}, epoch)
        for writer in self._writers.values():
            try:
                writer.flush()
            except write_errors() as error:
                self._failures.failed(error, self.log_dir)

    def on_train_end(self, logs=None):
        for writer in self._writers.values():
            try:
                writer.close()
            except write_errors() as error:
                self._failures.failed(error, self.log_dir)
        self._writers = {}


_FILE_NUMBERS = itertools.count()


class _EventFile:
    """One TensorBoard events file in a local `folder`: tensorboard's record
    format (length, checksums, a serialized Event), written in this thread."""

    def __init__(self, folder):
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        os.makedirs(folder, exist_ok=True)
        # The counter keeps two files of one second and process apart.
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{next(_FILE_NUMBERS)}.v2")
        self._records = RecordWriter(open(os.path.join(folder, name), "xb"))
        self.add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def add_event(self, event):
        self._records.write(event.SerializeToString())

    def flush(self):
        self._records.flush()

    def close(self):
        self._records.close()
