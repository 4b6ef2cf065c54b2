"""How a training run survives: its folders locked, its checkpoint restored, its preemption saved.

`MainLoop` (main_loop.py) schedules the callbacks around the steps; the
`Resumption` it holds does what makes a run survive its environment, at
three moments of the loop:

- before anything is read or written: lock the run's folders against a
  second run (`lock_folders`, kerastower/checkpoint/folder_lock.py);
- at the start: restore AutoResume's checkpoint on the chief, hand its
  variables and position to every process (`restore`), let that step-exact
  restore win over Keras's BackupAndRestore (`train_begin`), and say where
  training goes on, on the same or another number of towers
  (`start_position`, kerastower/checkpoint/resume_state.py);
- after every step: stop where every process agrees when one got a
  preemption signal, and save that step (`stop_if_preempted`,
  kerastower/loop/preemption.py).

docs/resuming.md tells the user's side of all of it.
"""

import os
import time
import warnings

import keras

from kerastower import _compat
from kerastower.callbacks import carried_state
from kerastower.callbacks.base import unwrapped
from kerastower.checkpoint import files as checkpoint_files
from kerastower.checkpoint import keys as checkpoint_keys
from kerastower.checkpoint.folder_lock import FolderLock
from kerastower.checkpoint.folder_lock import FolderLockedError
from kerastower.checkpoint.resume_state import ResumeState
from kerastower.errors import KerasTowerError
from kerastower.loop import preemption

__all__ = ["Resumption"]


class Resumption:
    """The resume, lock and preemption side of one training run's loop.

    Args:
        run: the `TrainingRun` (run.py) the loop trains.
    """

    def __init__(self, run):
        self.training_run = run
        self.model = run.model
        self.loop = run.state
        self.callbacks = run.callbacks
        self.name = run.name
        self.strategy = run.strategy
        self._watch = preemption.SignalWatch([])
        self._agreement = preemption.StopAgreement(self.strategy)
        self._locks = []  # the folders held, given back if the watchdog ends the process
        self._callback_arrays = {}  # the arrays of the callbacks' restored states

    def release(self, locks):
        """Gives back the folders `lock_folders` took, however training ended."""
        for lock in locks:
            try:
                lock.release()
            except OSError as error:  # the training's own error is the one to report
                warnings.warn(f"kerastower: could not release the lock of {lock.folder!r} "
                              f"({type(error).__name__}: {error}).")

    def lock_folders(self):
        """Takes, on the chief, the run's folders: its log folder and the
        checkpoint folders of its callbacks (AutoResume, ModelSaver,
        MinSaver: their `checkpoint_dir`). A second run on one
        of them refuses (`FolderLockedError`) before it reads or writes
        anything; the other processes of this run share the chief's."""
        if not self.strategy.is_chief:
            return []
        folders = [self.loop.logdir] + [
            getattr(unwrapped(callback), "checkpoint_dir", None)
            for callback in getattr(self.callbacks, "callbacks", self.callbacks) or []
        ]
        locks = []
        try:
            for folder in dict.fromkeys(os.path.realpath(f) for f in folders if f is not None):
                if os.path.exists(folder) and not os.path.isdir(folder):
                    continue  # not a folder: the callback that uses it says so
                lock = FolderLock(folder)
                try:
                    lock.acquire()
                except FolderLockedError:
                    raise
                except OSError as error:
                    # A folder that cannot be written: its own users say so.
                    warnings.warn(f"kerastower: {self.name} could not lock {folder!r} "
                                  f"against a second run ({type(error).__name__}: {error}).")
                    continue
                locks.append(lock)
        except BaseException:
            for lock in locks:
                lock.release()
            raise
        self._locks = locks
        return locks

    def restore(self):
        """Restores the newest checkpoint (AutoResume's) on the chief, then
        gives every process the chief's variables and resume state; returns
        that state, or None."""
        state = None
        if not self.strategy.single_process:
            # A restore builds the optimizers that build on first use (a
            # GAN's), which is collective under a multi-worker strategy:
            # every process builds them first, as the chief's newest
            # checkpoint says, then the chief restores.
            resumer = self.resumer()
            builds = self.strategy.broadcast_object(
                resumer.saved_optimizer_builds() if resumer and self.strategy.is_chief else None)
            checkpoint_keys.build_optimizers(self.model, builds, self.model.tower_strategy.scope)
        for callback in getattr(self.callbacks, "callbacks", self.callbacks):
            restore = getattr(unwrapped(callback), "restore_training_state", None)
            if restore is not None and self.strategy.is_chief:
                state = restore() or state
                self.training_run.restored_from = getattr(unwrapped(callback), "restored_from", None)
        state = self.strategy.broadcast_object(None if state is None else state.to_dict())
        self.strategy.sync_initial_state(self.model)
        self.strategy.seed_towers_apart(self.model)
        if state is None:
            return None
        state = ResumeState.from_dict(state)
        self.loop.global_step = state.global_step
        if state.callbacks:
            resumer = self.resumer()
            arrays = getattr(resumer, "restored_arrays", {}) if self.strategy.is_chief else None
            self._callback_arrays = (arrays if self.strategy.single_process
                                     else self.strategy.broadcast_object(arrays))
        return state

    def _restore_callbacks(self, state):
        """Gives the callbacks the states the checkpoint holds, after their
        on_train_begin (which resets Keras's)."""
        if state is not None and state.callbacks:
            carried_state.restore_states(self.callbacks, state.callbacks, self._callback_arrays)

    def train_begin(self, state):
        """The callbacks' on_train_begin. After AutoResume restored a
        checkpoint, the step-exact restore wins: Keras's BackupAndRestore
        (which would load its epoch-end backup over it there, while the
        input goes on at the checkpoint's step) is told, and loads nothing."""
        held = getattr(self.callbacks, "callbacks", None)
        losers = [] if state is None or held is None else [
            cb for cb in held if isinstance(cb, keras.callbacks.BackupAndRestore)]
        if not losers:
            self.callbacks.on_train_begin()
            self._restore_callbacks(state)
            return
        if self.strategy.is_chief:
            _compat.print_msg(
                f"{self.name}: AutoResume restored {self.training_run.restored_from} (global "
                f"step {state.global_step}), exact to the step; keras.callbacks.BackupAndRestore "
                "does not load its backup over it (it still backs up as it is set to).")
        self.callbacks.callbacks = [cb for cb in held if cb not in losers]
        try:
            self.callbacks.on_train_begin()
        finally:
            self.callbacks.callbacks = held
        self._restore_callbacks(state)

    def resumer(self):
        """The callback that restores and saves on preemption (AutoResume), or None."""
        for callback in getattr(self.callbacks, "callbacks", self.callbacks) or []:
            if hasattr(unwrapped(callback), "save_on_preemption"):
                return unwrapped(callback)
        return None

    def signal_watch(self):
        """Catches AutoResume's preemption signals while the steps run, and
        ends the process when the save cannot begin within AutoResume's
        `step_grace_s` of the first, or a second one comes first."""
        resumer = self.resumer()
        self._agreement = preemption.StopAgreement(self.strategy)
        self._watch = preemption.SignalWatch(
            resumer.save_on_signals if resumer else [],
            grace_s=getattr(resumer, "step_grace_s", preemption.STEP_GRACE_S),
            on_end=self._end_now)
        return self._watch

    def _end_now(self, reason):
        """What the watchdog says before it ends the process without a save
        (in its own thread, while the main thread is stuck): (status, message)."""
        resumer, loop = self.resumer(), self.loop
        status, folder = resumer.exit_status, os.fspath(resumer.checkpoint_dir)
        newest = None
        try:
            found = checkpoint_files.candidates(folder)
        except OSError:
            found = []
        if found:
            step, newest = found[-1]
            kept = (f"The checkpoints in {folder} are as they were (a save cut off leaves only "
                    f"a .writing-* folder, removed at the next start); the newest is {newest} "
                    f"(global step {step}): run the same command again and AutoResume goes on "
                    "from it.")
        else:
            kept = (f"No checkpoint had been written into {folder}: running the same command "
                    "again starts training over.")
        message = (
            f"{self.name}: {reason}, so training was interrupted after global step "
            f"{loop.global_step} (epoch {loop.epoch_num}), in the step or the callbacks after "
            f"it, without saving. Exiting at once with status {status}. {kept} (Raise "
            "AutoResume's step_grace_s, or pass None to wait for the step however long it "
            "takes, if steps or an epoch's validation legitimately take that long.)")
        preemption.report_to_launcher(status, message, newest)
        self.release(self._locks)
        return status, message

    def stop_if_preempted(self, epoch_end=False):
        """After a step (or an epoch's end): when any process got a
        preemption signal, every process stops here; the chief writes a
        checkpoint of this step, every process waits for it, and
        `Preempted` ends the run."""
        watch = self._watch
        if not watch.signals or not self._agreement.stop_now(
                watch.received is not None, self.loop.global_step, epoch_end):
            return
        resumer, loop = self.resumer(), self.loop
        started = time.perf_counter()
        # Every process: on JAX the towers' weights reach the variables by collectives.
        self.training_run.engine.sync_state()
        # JAX dispatches steps ahead of the loop: a step that never ends
        # shows here, still under the watchdog, not in the save.
        self.training_run.engine.wait_for_steps()
        watch.begin_save()  # the watchdog no longer ends the process: the save must complete
        path = resumer.save_on_preemption() if self.strategy.is_chief else None
        path = self.strategy.broadcast_object(path)
        name = watch.received_name
        if self.strategy.is_chief:
            saved_in = time.perf_counter() - started
            since = "" if watch.received_at is None else (
                f", {time.perf_counter() - watch.received_at:.2f} s after the signal")
            got = f"got {name}" if name else "another process got a preemption signal"
            more = (f" ({watch.count - 1} more signal(s) during the save were ignored: a save "
                    "under way completes, since it is what the next launch goes on from; a "
                    "second signal ends the process at once only while a step runs)"
                    if watch.count > 1 else "")
            _compat.print_msg(
                f"{self.name}: {got}; stopped after global step {loop.global_step} "
                f"(epoch {loop.epoch_num}, step {loop.local_step}) and saved {path} in "
                f"{saved_in:.2f} s (verified{since}){more}. Exiting with status "
                f"{resumer.exit_status}: run the same command again and AutoResume goes on "
                f"from global step {loop.global_step}."
            )
        preemption.report_to_launcher(
            resumer.exit_status, f"{self.name}: preempted after global step {loop.global_step}; "
            f"saved {path}", path)
        raise preemption.Preempted(resumer.exit_status, loop.global_step, path, name)

    def start_position(self, state, starting_epoch, steps_per_epoch):
        """(first epoch_num, its first step, batches each tower skips)."""
        loop = self.loop
        keras_epoch = _compat.initial_epoch(self.model)  # Keras's BackupAndRestore
        if state is None:
            return (keras_epoch + 1 if keras_epoch else starting_epoch), 0, None
        move = state.on_towers(self.model.num_towers, loop.batch_size)
        self._check_elastic(move)
        self._check_array_order(state)
        epoch_num, first_step, skip = move.state.start_position(steps_per_epoch)
        if skip is not None:
            loop.tower_batches = list(skip)
        if self.strategy.is_chief and getattr(self.callbacks, "params", {}).get("verbose", 1):
            _compat.print_msg(
                f"{self.name}: resumed from {self.training_run.restored_from or 'a checkpoint'} "
                f"(global step {state.global_step}): going on at epoch {epoch_num}, "
                f"step {first_step}.{' ' + move.describe() if move.changed else ''}"
            )
        elif move.changed and not move.exact and self.strategy.is_chief:
            warnings.warn(f"kerastower: {self.name} resumed on other towers. {move.describe()}")
        if state.steps_per_epoch != loop.steps_per_epoch and steps_per_epoch:
            _compat.print_msg(
                f"{self.name}: the checkpoint was written with steps_per_epoch="
                f"{state.steps_per_epoch}; with {steps_per_epoch} now, training goes on "
                f"at epoch {epoch_num}, step 0."
            )
        return epoch_num, first_step, skip

    def _check_array_order(self, state):
        """Says when the arrays are now shuffled in another order than the
        checkpoint's run read them in (`inputs/keras_order.py`): resumed on
        the other backend, or across processes, with Keras's seed set."""
        saved, now = state.array_order, self.loop.array_order
        if saved is None or now is None or saved == now:
            return
        message = (
            f"{self.name}: the checkpoint's run read the shuffled arrays in {saved!r} order, "
            f"this run reads them in {now!r} order (stock Keras's order differs between "
            "TensorFlow and JAX, and is followed only where Keras's seed is set): "
            "from the resumed epoch on, the steps take other examples than the "
            "uninterrupted run, and the interrupted epoch may repeat or skip some. To "
            "resume exactly, resume where the checkpoint was written, or train with "
            "shuffle=False.")
        if getattr(self.resumer(), "strict", False):
            raise KerasTowerError(f"AutoResume(strict=True) refuses: {message}")
        if self.strategy.is_chief:
            warnings.warn(f"kerastower: {message}", stacklevel=2)

    def _check_elastic(self, move):
        """Refuses a resume that cannot equal the uninterrupted run when
        AutoResume asks for strict reproduction (`strict=True`)."""
        resumer = self.resumer()
        if not move.changed or move.exact or not getattr(resumer, "strict", False):
            return
        why = ("the source makes its own batches, so whether a step holds as many examples "
               "as then cannot be known" if move.state.batch_size is None or
               move.saved.batch_size is None else
               "the total batch differs" if not move.same_total_batch else
               "the saved position is not a whole number of this run's steps")
        raise KerasTowerError(
            f"AutoResume(strict=True) refuses to resume from "
            f"{self.training_run.restored_from}: {move.describe()} Exactly the uninterrupted "
            f"run cannot be reproduced: {why}. Resume with the same total batch "
            "(towers x batch_size) on numpy arrays, or with the same number of towers, or "
            "pass strict=False to go on anyway."
        )
