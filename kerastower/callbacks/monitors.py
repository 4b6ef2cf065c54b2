"""Monitors: what training reports, written by the chief.

| callback | what it does |
|---|---|
| `ProgressBar` | Keras's progress bar plus samples/s over all towers (fit's default) |
| `ThroughputTracker` | `samples_per_sec` of every epoch, all towers counted, into the logs |
| `EstimatedTimeLeft` | prints the time left, from the median epoch time |
| `ScalarPrinter` | prints the epoch's scalars, one per line |
| `JSONWriter(logdir)` | `logdir/stats.json`: a list of epoch records, rewritten atomically, continued on resume |
| `TensorBoard(logdir)` | Keras's TensorBoard with step and epoch scalars, chief only |
| `PeakMemoryTracker` | `peak_memory_mb` of every epoch, where the device reports it (GPUs) |

`model.fit(..., logdir=path)` adds TensorBoard, JSONWriter and
ThroughputTracker unless the list already has them. The kt monitors add,
print or write when triggered (by default, at every epoch end), so a
`PeriodicTrigger` or `EnableCallbackIf` around one chooses when.

Monitors never stop training: when JSONWriter or TensorBoard cannot write
(the log folder is a file, cannot be created, or the disk is full), each
warns once with a `kt.errors.MonitorWriteWarning` naming the path and the
error, and training, the other callbacks and checkpoints go on.
"""

import json
import os
import statistics
import threading
import time

import keras

from kerastower._tf import tf
from kerastower import _compat
from kerastower.arguments import integer
from kerastower.callbacks.base import Callback
from kerastower.callbacks.base import RunAware
from kerastower.callbacks.write_guard import write_errors
from kerastower.errors import KerasTowerError
from kerastower.callbacks.write_guard import WriteFailures
from kerastower.callbacks.write_guard import never_raising_a_write_error

__all__ = [
    "ProgressBar",
    "ThroughputTracker",
    "EstimatedTimeLeft",
    "ScalarPrinter",
    "JSONWriter",
    "TensorBoard",
    "PeakMemoryTracker",
    "OptimizerMemoryTracker",
    "optimizer_state_bytes",
]


class ProgressBar(RunAware, keras.callbacks.ProgbarLogger):
    """Keras's progress bar, showing samples/s summed over all towers, and
    at each epoch's end the learning rate. fit puts it after every other
    callback, as Keras does its own, so the epoch line has what they added
    to the logs (InferenceRunner's val_*, samples_per_sec).

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> _ = model.fit(x, y, batch_size=4, verbose=2)   # verbose=1 or 2 put one last in the list
        kerastower: 1 tower(s) x 4 examples = total batch 4 per step
        4/4 - ... - loss: ... - learning_rate: 0.0100
    """

    chief_only = True
    _handed_at = None  # when `shows` last said yes

    @property
    def async_safe(self):
        """True: its batch hook only shows the logs, so Keras's CallbackList
        may run it in its thread and reading a step's logs never holds up
        the next step (as Keras's own progress bar, added after that choice,
        is run). Not for a subclass, which may read more."""
        return type(self) is ProgressBar

    def on_epoch_end(self, epoch, logs=None):
        shown = dict(logs or {})
        rate = _learning_rate(self.model)
        if rate is not None:
            shown.setdefault("learning_rate", rate)
        super().on_epoch_end(epoch, shown)

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        self._epoch_start = (time.perf_counter(), self.loop.examples_seen)
        self._shown = (threading.Lock(), [-1])
        self._handed_at = None

    def shows(self, step):
        """Whether the bar may draw `step`: the epoch's first step it sees,
        then (`verbose=1`) one each half of Keras's `Progbar.interval` (the
        bar itself draws at most once an interval); with `verbose=2` the
        first only, which starts the bar's time per step. fit hands its
        batch hook only those steps, and the epoch's last, where no other
        callback has a batch hook and the bar shows each metric's last
        value (`shows_last_values`; loop/batch_hooks.py): what the bar
        shows is the same, and no step waits for a hand-off it does not
        need."""
        now = time.perf_counter()
        first = self._handed_at is None
        if self.verbose != 1:
            self._handed_at = now
            return first
        interval = getattr(self.progbar, "interval", 0.05)
        if not first and now - self._handed_at < interval / 2:
            return False
        self._handed_at = now
        return True

    def shows_last_values(self):
        """Whether the epoch's `Progbar` shows every metric as the last value
        handed (Keras 3.15's ProgbarLogger), not an average over the steps
        handed (Keras 3.10-3.14), which needs every step."""
        progbar = self.progbar
        return (progbar is not None and getattr(progbar, "stateful_metrics", ()) is None
                and getattr(progbar, "stateless_metrics", None) == set())

    def on_train_batch_end(self, batch, logs=None):
        # Keras's thread pool may run two steps' hooks at once, or a later
        # step's first: the bar moves forward only.
        lock, last = self._shown
        with lock:
            if batch <= last[0]:
                return
            last[0] = batch
            start_time, start_examples = self._epoch_start
            seconds = time.perf_counter() - start_time
            examples = self.loop.examples_seen - start_examples
            shown = dict(logs or {})
            if seconds > 0 and examples > 0:
                shown["samples/s"] = examples / seconds
            super().on_train_batch_end(batch, shown)


def _learning_rate(model):
    """The optimizer's current learning rate as a float, or None."""
    rate = getattr(getattr(model, "optimizer", None), "learning_rate", None)
    try:
        return float(keras.ops.convert_to_numpy(rate))
    except (TypeError, ValueError):
        return None


class ThroughputTracker(Callback):
    """Adds `samples_per_sec` (examples of all towers per second) and
    `steps_per_sec` to the logs when triggered (by default, at every epoch
    end), measured since the epoch began or the last trigger, the later.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> history = model.fit(x, y, batch_size=4, verbose=0, callbacks=[kt.callbacks.ThroughputTracker()])
        >>> sorted(history.history)
        ['loss', 'samples_per_sec', 'steps_per_sec']
    """

    def _start_measuring(self):
        self._start = (time.perf_counter(), self.loop.examples_seen, self.global_step)

    def _before_train(self):
        self._start_measuring()

    def _before_epoch(self):
        self._start_measuring()

    def _trigger(self):
        start_time, start_examples, start_step = self._start
        seconds = max(time.perf_counter() - start_time, 1e-9)
        if self.logs is not None:
            self.logs["samples_per_sec"] = (self.loop.examples_seen - start_examples) / seconds
            self.logs["steps_per_sec"] = (self.global_step - start_step) / seconds
        self._start_measuring()


class EstimatedTimeLeft(Callback):
    """Prints the estimated time left when triggered (by default, after each
    epoch): the median epoch time so far times the epochs still to run.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> _ = model.fit(x, y, batch_size=4, epochs=3, verbose=0,
        ...               callbacks=[kt.callbacks.EstimatedTimeLeft()])
        EstimatedTimeLeft: 0h 00m 0...s for 2 more epoch(s)
        EstimatedTimeLeft: 0h 00m 0...s for 1 more epoch(s)
    """

    def __init__(self):
        super().__init__()
        self.durations = []
        self.estimate = None

    def _before_epoch(self):
        self._start = time.perf_counter()

    def _trigger(self):
        self.durations.append(time.perf_counter() - self._start)
        left = self.loop.max_epoch - self.epoch_num
        self.estimate = statistics.median(self.durations) * left
        if left > 0:
            minutes, seconds = divmod(int(round(self.estimate)), 60)
            hours, minutes = divmod(minutes, 60)
            _compat.print_msg(
                f"EstimatedTimeLeft: {hours}h {minutes:02d}m {seconds:02d}s "
                f"for {left} more epoch(s)"
            )


class ScalarPrinter(Callback):
    """Prints every scalar of the logs when triggered (by default, the epoch
    logs at every epoch end), one per line, as tensorpack did.

    Args:
        whitelist: names to print (default: all).

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> _ = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[kt.callbacks.ScalarPrinter()])
        [epoch 1, step 4] loss: ...
        [epoch 2, step 8] loss: ...
    """

    def __init__(self, whitelist=None):
        super().__init__()
        self.whitelist = None if whitelist is None else set(whitelist)

    def _trigger(self):
        for name, value in sorted((self.logs or {}).items()):
            if self.whitelist is None or name in self.whitelist:
                _compat.print_msg(f"[epoch {self.epoch_num}, step {self.global_step}] {name}: {float(value):.6g}")


class JSONWriter(Callback):
    """Keeps `logdir/stats.json`: one record per trigger (by default, per
    epoch) with `epoch_num`, `global_step` and the logs.

    The file is rewritten through a temporary file and an atomic rename, so
    it is always valid JSON. A resumed run keeps the records up to the step
    it resumed from and appends after them.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> import json
        >>> _ = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[kt.callbacks.JSONWriter("logs")])
        >>> with open("logs/stats.json") as f:
        ...     [(record["epoch_num"], record["global_step"]) for record in json.load(f)]
        [(1, 4), (2, 8)]
    """

    FILENAME = "stats.json"

    def __init__(self, logdir):
        super().__init__()
        self.logdir = logdir
        self.records = []
        self._failures = WriteFailures("JSONWriter")
        self._writable = True

    @property
    def path(self):
        return os.path.join(self.logdir, self.FILENAME)

    def _before_train(self):
        self.records = []
        self._failures.reset()
        self._writable = True
        try:
            os.makedirs(self.logdir, exist_ok=True)
            previous = self._previous_records()
        except (OSError, ValueError) as error:
            # Writing now would lose the records of the run this resumes.
            self._writable = False
            self._failures.failed(error, self.path)
            return
        # Records past the step training resumes from belong to a run
        # that was lost; they are replaced by the ones to come.
        self.records = [r for r in previous if r["global_step"] <= self.global_step]

    def _previous_records(self):
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return json.load(f)

    def _trigger(self):
        record = {"epoch_num": self.epoch_num, "global_step": self.global_step}
        record.update({k: float(v) for k, v in (self.logs or {}).items()})
        self.records.append(record)
        if not self._writable:
            return
        staging = self.path + ".writing"
        try:
            with open(staging, "w") as f:
                json.dump(self.records, f, indent=1)
            os.replace(staging, self.path)
        except OSError as error:
            # The records stay in memory: a later trigger that can write
            # writes them all.
            self._failures.failed(error, self.path)
            try:
                os.remove(staging)
            except OSError:
                pass


class TensorBoard(RunAware, keras.callbacks.TensorBoard):
    """Keras's TensorBoard callback, writing step scalars (`batch_*`) and
    epoch scalars (`epoch_*`), on the chief only.

    Its step axis is the loop's global step (`TrainingRun.state.global_step`, which `model.loop` shows), not
    Keras's count of batch hooks: with `steps_per_execution=k` the scalars
    are at the steps the hooks ran after, and a resumed run goes on from
    the step it resumed at. An integer `update_freq=n` writes after the
    calls that reach a multiple of n steps. When it cannot write `log_dir`,
    it warns once and writes nothing more in that run (see the module
    docstring).

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> import os
        >>> _ = model.fit(x, y, batch_size=4, epochs=2, verbose=0,
        ...               callbacks=[kt.callbacks.TensorBoard("tensorboard")])
        >>> os.listdir("tensorboard")     # read it with `tensorboard --logdir tensorboard`
        ['train']
    """

    chief_only = True

    def __init__(self, log_dir="logs", update_freq="batch", **kwargs):
        if not (isinstance(update_freq, str) and update_freq in ("batch", "epoch")):
            update_freq = integer(update_freq, 'update_freq (or "batch", "epoch")',
                                  "TensorBoard", minimum=1)
        super().__init__(log_dir=log_dir, update_freq=update_freq, **kwargs)
        self._last_written_step = 0
        self._failures = WriteFailures("TensorBoard")
        from kerastower.callbacks.summary_guard import GuardedSummary  # TensorFlow's

        self._guarded_summary = GuardedSummary(self._failures, self.log_dir)

    @property
    def summary(self):
        # Keras's TensorBoard makes its writers and writes through this.
        return self._guarded_summary

    def set_model(self, model):
        self._failures.reset()
        try:
            super().set_model(model)
        except write_errors() as error:
            self._failures.failed(error, self.log_dir)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        self._last_written_step = self.loop.global_step

    def on_train_batch_begin(self, batch, logs=None):
        # Keras adds one: summaries written inside the call get its first step.
        self._global_train_batch = self.loop.global_step
        super().on_train_batch_begin(batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        step = self._global_train_batch = self.loop.global_step
        if self.update_freq == "epoch":
            super().on_train_batch_end(batch, logs)
            return
        due = step // self.update_freq > self._last_written_step // self.update_freq
        self._last_written_step = step
        with tf.summary.record_if(due):
            super().on_train_batch_end(batch, logs)


# After a failed write the hooks still run (they pop the writers they
# pushed), but write nothing: GuardedSummary's writers and summaries stop.
for _hook in (
    "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
    "on_train_batch_begin", "on_train_batch_end", "on_test_begin", "on_test_end",
    "on_test_batch_begin", "on_test_batch_end",
):
    setattr(TensorBoard, _hook, never_raising_a_write_error(getattr(TensorBoard, _hook)))


class PeakMemoryTracker(Callback):
    """Adds `peak_memory_mb` (the largest over the towers' devices) to the
    logs when triggered (by default, at every epoch end), the peak since the
    epoch began or the last trigger, on devices that report memory (GPUs);
    elsewhere it adds nothing. JAX cannot reset a device's peak: there it
    is the peak since the process started.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> history = model.fit(x, y, batch_size=4, verbose=0, callbacks=[kt.callbacks.PeakMemoryTracker()])
        >>> "peak_memory_mb" in history.history       # CPUs report no memory
        False
    """

    def _before_epoch(self):
        self.model.engine.reset_memory_peaks()

    def _trigger(self):
        peaks = self.model.engine.memory_peaks()
        if peaks and self.logs is not None:
            self.logs["peak_memory_mb"] = max(peaks) / 2**20
        self.model.engine.reset_memory_peaks()


def optimizer_state_bytes(model):
    """{device name: bytes of the optimizer's state on it}, over the towers' devices of this process.

    Read from the devices' buffers. Each tower's device holds the whole
    state (Adam: two slots the size of the weights, the step count, the
    learning rate), except under `kt.distributed(..., shard_optimizer=True)`,
    where each of N towers holds 1/N of every slot
    (docs/sharded-optimizer.md). `kt.callbacks.OptimizerMemoryTracker`
    logs the largest at each epoch's end.

    Args:
        model: a compiled `kt.TowerModel`.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(2)(inputs))
        >>> model.compile(optimizer="adam", loss="mse")
        >>> _ = model.fit(np.ones((8, 3)), np.ones((8, 2)), batch_size=4, verbose=0)
        >>> held = kt.optimizer_state_bytes(model)      # one device: Adam's 2 x 8 floats and 2 scalars
        >>> len(held), 64 < min(held.values()) <= 64 + 16
        (1, True)
    """
    optimizer = getattr(model, "optimizer", None)
    engine = getattr(model, "engine", None)
    if optimizer is None or engine is None:
        raise KerasTowerError(
            f"kt.optimizer_state_bytes({type(model).__name__}): the model has no optimizer yet; "
            "pass a kt.TowerModel after compile(optimizer=...).")
    if not optimizer.built:
        raise KerasTowerError(
            f"kt.optimizer_state_bytes: {optimizer.name} has no state yet (it is built at the "
            "first fit); call it after fit, or in a callback.")
    return engine.optimizer_state_bytes()


class OptimizerMemoryTracker(Callback):
    """Adds `optimizer_state_mb` to the logs when triggered (by default, at
    every epoch end): the optimizer state the fullest tower device holds,
    read from the devices' buffers (`kt.optimizer_state_bytes`). Under
    `kt.distributed(..., shard_optimizer=True)` it falls as 1/N of the
    replicated figure over N towers (docs/sharded-optimizer.md).

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(2)(inputs))
        >>> model.compile(optimizer="adam", loss="mse")
        >>> history = model.fit(np.ones((8, 3)), np.ones((8, 2)), batch_size=4, verbose=0,
        ...                     callbacks=[kt.callbacks.OptimizerMemoryTracker()])
        >>> 64 < history.history["optimizer_state_mb"][0] * 2**20 <= 64 + 16   # Adam: 2 x 8 floats, 2 scalars
        True
    """

    def _trigger(self):
        held = optimizer_state_bytes(self.model)
        if held and self.logs is not None:
            self.logs["optimizer_state_mb"] = max(held.values()) / 2**20
