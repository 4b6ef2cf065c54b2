"""Checkpoints and exact auto-resume.

```python
import kerastower as kt

callbacks = [
    kt.callbacks.AutoResume("ckpt"),                 # restores the newest intact checkpoint, if any
    kt.callbacks.ModelSaver("ckpt", max_to_keep=3),  # at the end of every epoch
    kt.callbacks.PeriodicTrigger(kt.callbacks.ModelSaver("ckpt"), every_k_steps=500),
    kt.callbacks.MinSaver("val_loss", "best"),       # keeps the best model seen
]
```

A checkpoint holds the weights, the optimizer's slots and step counter, the
random-number states, the loop state (epoch, steps) and the input position
(batches each tower took), with a manifest of checksums, in a folder written
under a temporary name and renamed into place (`kerastower/checkpoint/store.py`; read back by `restore.py`):
a kill during a save leaves the previous checkpoint as the newest, and a
damaged checkpoint is skipped for the one before it.
"""

import os
import time
import warnings

from kerastower.checkpoint import restore as checkpoint_restore
from kerastower.checkpoint import store as checkpoint
from kerastower.checkpoint import files as checkpoint_files
from kerastower.arguments import integer
from kerastower.callbacks import carried_state
from kerastower.callbacks.base import Callback
from kerastower.callbacks.write_guard import write_errors
from kerastower.errors import KerasTowerError
from kerastower.checkpoint.resume_state import ResumeState
from kerastower.callbacks import preemption_settings as preemption

__all__ = ["ModelSaver", "MinSaver", "MaxSaver", "AutoResume"]


def _run_state(callback):
    """(the position of `callback`'s training run, as a checkpoint's state,
    with its callbacks' states; the numpy arrays those hold)."""
    state = ResumeState.of(callback.loop, callback.model.num_towers)
    run, arrays = callback.training_run, {}
    if run is not None and run.callbacks is not None:
        state.callbacks, arrays = carried_state.states_of(run.callbacks)
    return state.to_dict(), arrays


class ModelSaver(Callback):
    """Saves a checkpoint whenever triggered (by default, every epoch end).

    A checkpoint whose variables hold NaN or Inf is not written: a warning
    names the step and the variables, and the older checkpoints stay.

    Retention: the `max_to_keep` newest intact checkpoints stay, plus those
    kept for good; the one just written and damaged ones (which AutoResume
    skips, and which do not count) are never deleted. Whether a checkpoint
    is kept for good, and when the last one was, is written in each
    checkpoint's manifest and read from there, so it holds across restarts
    and between several ModelSavers of one directory.

    Args:
        checkpoint_dir: where `ckpt-<global_step>` folders go.
        max_to_keep: how many recent checkpoints to keep (None: all).
        keep_checkpoint_every_n_hours: also keep, for good, one checkpoint
            per this many hours of wall-clock time (None: none).

    Attributes:
        clock: the function giving the time for `keep_checkpoint_every_n_hours`
            (`time.time`; a test may replace it).

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> import os
        >>> _ = model.fit(x, y, batch_size=4, epochs=3, verbose=0,
        ...               callbacks=[kt.callbacks.ModelSaver("ckpt", max_to_keep=2)])
        >>> sorted(os.listdir("ckpt"))        # epochs 2 and 3 end at global steps 8 and 12
        ['ckpt-00000008', 'ckpt-00000012']
    """

    def __init__(self, checkpoint_dir, max_to_keep=10, keep_checkpoint_every_n_hours=None):
        super().__init__()
        max_to_keep = integer(max_to_keep, "max_to_keep", "ModelSaver", minimum=1, none_ok=True)
        self.checkpoint_dir = checkpoint_dir
        self.max_to_keep = max_to_keep
        self.keep_every_s = (
            None if keep_checkpoint_every_n_hours is None else keep_checkpoint_every_n_hours * 3600
        )
        self.clock = time.time
        self._started = None
        self._verified = {}  # path -> manifest checksum, of checkpoints found intact

    def _before_train(self):
        writable_folder(self.checkpoint_dir, "ModelSaver")
        checkpoint.clean_up(self.checkpoint_dir)
        self._started = self.clock()

    def _manifests(self):
        """(path, manifest or None when unreadable) of every checkpoint, newest first."""
        found = []
        for _, path in reversed(checkpoint.list_checkpoints(self.checkpoint_dir)):
            try:
                found.append((path, checkpoint_files.read_manifest(path)))
            except checkpoint.DamagedCheckpointError:
                found.append((path, None))
        return found

    def _trigger(self):
        # At an epoch's end, once every callback's hook has run.
        if self.training_run is None:
            self._write()
        else:
            self.training_run.when_callbacks_done(self._write)

    def _write(self):
        state, arrays = _run_state(self)
        now = self.clock()
        manifests = self._manifests()
        retentions = {path: (manifest or {}).get("retention", {}) for path, manifest in manifests}
        times = [r["last_kept_time"] for r in retentions.values()
                 if r.get("last_kept_time") is not None]
        last_kept = max(times) if times else (self._started if self._started is not None else now)
        final = checkpoint_files.folder_path(self.checkpoint_dir, state["global_step"])
        newly_kept = self.keep_every_s is not None and now - last_kept >= self.keep_every_s
        retention = {
            "kept_for_good": newly_kept or bool(retentions.get(final, {}).get("kept_for_good")),
            "last_kept_time": now if newly_kept else last_kept,
            "written_at": now,
        }
        try:
            path = checkpoint.write_checkpoint(self.checkpoint_dir, self.model, state, retention,
                                               callback_arrays=arrays)
        except checkpoint.NonFiniteCheckpointError as error:
            warnings.warn(f"kerastower: ModelSaver: {error}", stacklevel=2)
            return
        except write_errors() as error:
            # Training on without checkpoints would risk days of work: stop,
            # saying what is kept.
            raise KerasTowerError(
                f"ModelSaver could not write the checkpoint of global step "
                f"{state['global_step']} into {self.checkpoint_dir!r}: "
                f"{type(error).__name__}: {error}. The checkpoints written before are "
                "intact; free space (or fix the folder) and run again with "
                "kt.callbacks.AutoResume to go on from the newest of them."
            ) from error
        self._verified[path] = checkpoint_files.read_manifest(path)["checksum"]
        self._prune(path)

    def _intact(self, path, manifest):
        if manifest is None:
            return False
        if self._verified.get(path) != manifest["checksum"]:
            try:
                checkpoint.verify_checkpoint(path)
            except checkpoint.DamagedCheckpointError:
                return False
            self._verified[path] = manifest["checksum"]
        return True

    def _prune(self, just_written):
        """Deletes the intact checkpoints older than the `max_to_keep`
        newest, except those kept for good; never the one just written, nor
        damaged ones (which do not count)."""
        if self.max_to_keep is None:
            return
        kept = 0
        for path, manifest in self._manifests():
            if path != just_written and not self._intact(path, manifest):
                continue
            kept += 1
            for_good = (manifest or {}).get("retention", {}).get("kept_for_good")
            if kept > self.max_to_keep and path != just_written and not for_good:
                checkpoint_files.remove(path)
                self._verified.pop(path, None)


def writable_folder(folder, owner):
    """Makes `folder` if needed; a KerasTowerError naming it and the cause,
    at start, when it is a file or cannot be written."""
    folder = os.fspath(folder)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise KerasTowerError(
            f"{owner}: the checkpoint folder {folder!r} is a file, not a folder. Give "
            "another path, or move the file away."
        )
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise KerasTowerError(
            f"{owner} cannot make its checkpoint folder {folder!r}: "
            f"{type(error).__name__}: {error}. Give a folder this process can write."
        ) from error
    if not os.access(folder, os.W_OK | os.X_OK):
        raise KerasTowerError(
            f"{owner} cannot write into its checkpoint folder {folder!r} (no permission "
            "for this user). Give a folder this process can write, or change its "
            "permissions."
        )


class _BestSaver(Callback):
    """Saves the model as `<filename>.keras` when triggered (by default, at
    every epoch end) and `stat` in the logs is a new best."""

    def __init__(self, stat, filename=None, checkpoint_dir=None, better=None):
        super().__init__()
        self.stat = stat
        self.filename = filename or f"{type(self).__name__.lower().replace('saver', '')}-{stat}"
        self.checkpoint_dir = checkpoint_dir
        self._better = better
        self.best = None

    @property
    def folder(self):
        """`checkpoint_dir`, else the run's log folder (`fit(logdir=...)`)."""
        if self.checkpoint_dir is not None:
            return os.fspath(self.checkpoint_dir)
        run = self.training_run
        return None if run is None else run.state.logdir

    @property
    def path(self):
        return os.path.join(self.folder, self.filename + ".keras")

    def _before_train(self):
        if self.folder is None:
            name = type(self).__name__
            raise KerasTowerError(
                f"{name}({self.stat!r}) has no folder to save the best model into: "
                "give the run a log folder, fit(..., logdir='runs/1') (where "
                f"TensorBoard, stats.json and {name} write), or give "
                f"{name}(..., checkpoint_dir=...) a folder of its own."
            )

    def get_resume_state(self):
        """The best value seen, saved with the run's checkpoints (carried_state.py)."""
        return {"best": self.best}

    def set_resume_state(self, state):
        self.best = state["best"]

    def _trigger(self):
        value = self.read_stat(self.logs, self.stat)
        if self.best is None or self._better(value, self.best):
            self.best = value
            os.makedirs(self.folder, exist_ok=True)
            staging = self.path + ".writing.keras"
            self.model.save(staging)
            os.replace(staging, self.path)


class MinSaver(_BestSaver):
    """Keeps the model with the lowest `stat` (an epoch-log key such as
    "val_loss") as `<filename>.keras` in `checkpoint_dir`, by default the
    run's log folder (`fit(..., logdir=...)`).

    Examples:
        >>> import os
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> _ = model.fit(x, y, batch_size=4, epochs=2, verbose=0, validation_data=(x, y),
        ...               callbacks=[kt.callbacks.MinSaver("val_loss", checkpoint_dir="best")])
        >>> os.listdir("best")
        ['min-val_loss.keras']
    """

    def __init__(self, stat, filename=None, checkpoint_dir=None):
        super().__init__(stat, filename, checkpoint_dir, better=lambda new, best: new < best)


class MaxSaver(_BestSaver):
    """Keeps the model with the highest `stat` (e.g. "val_accuracy") as
    `<filename>.keras` in `checkpoint_dir`, by default the run's log folder
    (`fit(..., logdir=...)`): `runs/1/max-val_accuracy.keras`.

    Examples:
        >>> import os
        >>> inputs = keras.Input((2,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(2, activation="softmax")(inputs))
        >>> model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        >>> x, y = np.array([[1.0, 0.0], [0.0, 1.0]] * 4), np.array([0, 1] * 4)
        >>> _ = model.fit(x, y, batch_size=4, epochs=2, verbose=0, validation_data=(x, y),
        ...               logdir="runs/1", callbacks=[kt.callbacks.MaxSaver("val_accuracy")])
        >>> sorted(os.listdir("runs/1"))      # with TensorBoard's and JSONWriter's files
        ['max-val_accuracy.keras', 'stats.json', 'train', 'validation']
    """

    def __init__(self, stat, filename=None, checkpoint_dir=None):
        super().__init__(stat, filename, checkpoint_dir, better=lambda new, best: new > best)


class AutoResume(Callback):
    """Restores the newest intact checkpoint in `checkpoint_dir` when fit starts.

    Like Keras's BackupAndRestore, but exact to the step: weights, optimizer
    slots, global_step, random-number states, epoch, step in the epoch, and
    the input position are restored, and training goes on as if it had never
    stopped (with deterministic ops and a deterministic input pipeline, the
    final weights are bit-equal to an uninterrupted run's). Pair it with a
    ModelSaver writing to the same directory. Without a checkpoint it does
    nothing.

    Before reading, it removes what killed saves left (`.writing-*`
    folders). A checkpoint that is incomplete, damaged (a file truncated or
    changed, a missing manifest) or holds NaN/Inf is skipped with a warning
    saying why, for the one before it; with checkpoints there and none
    intact, it raises a KerasTowerError naming each and its reason.
    Variables are matched by their Keras path (kerastower/checkpoint/keys.py):
    the model must have exactly the checkpoint's variables, shapes and
    dtypes, or `allow_partial=True` restores those that fit and warns about
    the others.

    The input position is restored by skipping the batches each tower had
    taken, which replays the pipeline's work for them; when an epoch is one
    pass over finite data (no steps_per_epoch), by skipping those taken in
    the interrupted pass, whose order is replayed (docs/epochs.md).

    A checkpoint of another number of towers resumes too: on numpy arrays
    at the same example, exactly when the total batch (towers x batch_size)
    is the same; the start line says what changed (docs/resuming.md).

    While training runs, the `save_on_signals` (SIGTERM and SIGUSR1; `()`
    turns it off) stop it after the current step, on every process alike;
    the chief writes and verifies a checkpoint of that step into
    `checkpoint_dir`, and `kt.Preempted` ends the process with
    `exit_status`. A step that has not ended `step_grace_s` seconds after
    the signal, or a second signal while it runs, ends the process at once
    with `exit_status` and a message, without a save: the checkpoints
    already written stay intact, and the next launch goes on from the
    newest (a second signal during the save itself is ignored: the save
    completes). The run's folders are locked against a second run
    (kerastower/checkpoint/folder_lock.py).

    Args:
        checkpoint_dir: the folder of the checkpoints (ModelSaver's).
        allow_partial: restore the variables that fit, warn about the rest.
        strict: refuse a resume that cannot equal the uninterrupted run
            (another total batch, a source that batches itself on other
            towers).
        save_on_signals: signal names or numbers that save and stop.
        exit_status: the exit status after such a save (75, EX_TEMPFAIL).
        step_grace_s: how many seconds after the first signal the save may
            wait for the running step (and the callbacks after it, an
            epoch's validation included) to end; past it the process ends
            at once with `exit_status`, without a save. 120 s by default:
            longer than most steps, about the longest kill grace schedulers
            give (SLURM and Kubernetes 30 s by default, AWS spot 2
            minutes), so that a step stuck in C++ code (a dead collective,
            a hung input) no longer holds the machine. None waits forever.

    Examples:
        >>> def train(epochs):
        ...     inputs = keras.Input((3,))
        ...     model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        ...     model.compile(optimizer="sgd", loss="mse")
        ...     model.fit(np.ones((16, 3)), np.ones((16, 1)), batch_size=4, epochs=epochs, verbose=0,
        ...               callbacks=[kt.callbacks.AutoResume("ckpt"), kt.callbacks.ModelSaver("ckpt")])
        ...     return model
        >>> _ = train(epochs=1)          # stopped after epoch 1 (4 steps)
        >>> model = train(epochs=3)      # a new process would do the same: epochs 2 and 3 only
        >>> model.loop.global_step, int(model.optimizer.iterations)
        (12, 12)
    """

    def __init__(self, checkpoint_dir, allow_partial=False, strict=False,
                 save_on_signals=preemption.DEFAULT_SIGNALS, exit_status=preemption.EXIT_STATUS,
                 step_grace_s=preemption.STEP_GRACE_S):
        super().__init__()
        self.checkpoint_dir = checkpoint_dir
        self.allow_partial = allow_partial
        self.strict = bool(strict)
        self.save_on_signals = preemption.signal_numbers(save_on_signals, "AutoResume")
        self.exit_status = integer(exit_status, "exit_status", "AutoResume", minimum=0)
        self.step_grace_s = preemption.grace_seconds(step_grace_s, "AutoResume")
        self.restored_from = None
        self.restored_arrays = {}  # the arrays of the restored callbacks' states
        # Runs on every process, so the chief's restored state reaches all.
        self.chief_only = False

    def saved_optimizer_builds(self):
        """What restoring the newest intact checkpoint will build (the
        optimizers that build on first use), or None; read on the chief."""
        if not os.path.isdir(self.checkpoint_dir):
            return None
        return checkpoint_restore.saved_optimizer_builds(self.checkpoint_dir)

    def restore_training_state(self):
        """Restores the newest intact checkpoint into the model; returns its
        `ResumeState`, or None without one. The training loop calls it on
        the chief before `on_train_begin`, then broadcasts the variables and
        the state to every other process."""
        if os.path.exists(self.checkpoint_dir) and not os.path.isdir(self.checkpoint_dir):
            raise KerasTowerError(
                f"AutoResume: the checkpoint folder {os.fspath(self.checkpoint_dir)!r} is a "
                "file, not a folder. Give the folder ModelSaver writes into."
            )
        checkpoint.clean_up(self.checkpoint_dir)
        path, values = checkpoint_restore.restore_latest(
            self.checkpoint_dir, self.model, allow_partial=self.allow_partial
        )
        if path is None:
            return None
        state = ResumeState.from_dict(values)
        self.restored_from = path
        self.restored_arrays = checkpoint.read_callback_arrays(path)
        return state

    def save_on_preemption(self):
        """Writes and verifies a checkpoint of the loop's position now (after
        the step every process agreed to stop at); returns its path. Runs
        on the chief."""
        state, arrays = _run_state(self)
        path = checkpoint.write_checkpoint(self.checkpoint_dir, self.model, state,
                                           callback_arrays=arrays)
        checkpoint.verify_checkpoint(path)
        return path
