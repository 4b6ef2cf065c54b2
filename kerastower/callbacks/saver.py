"""Checkpoints and exact auto-resume.

```python
import kerastower as kt

callbacks = [
    kt.callbacks.AutoResume("ckpt"),                 # restores the latest checkpoint, if any
    kt.callbacks.ModelSaver("ckpt", max_to_keep=3),  # at the end of every epoch
    kt.callbacks.PeriodicTrigger(kt.callbacks.ModelSaver("ckpt"), every_k_steps=500),
    kt.callbacks.MinSaver("val_loss", "best"),       # keeps the best model seen
]
```

A checkpoint holds the weights, the optimizer's slots and step counter, the
random-number states, the loop state (epoch, steps) and the input position
(batches each tower took), in a folder written under a temporary name and
renamed into place (`kerastower/checkpoint.py`): a kill during a save leaves
the previous checkpoint as the latest.
"""

import os
import shutil
import time

from kerastower import checkpoint
from kerastower.callbacks.base import Callback
from kerastower.resume import ResumeState

__all__ = ["ModelSaver", "MinSaver", "MaxSaver", "AutoResume"]


class ModelSaver(Callback):
    """Saves a checkpoint whenever triggered (by default, every epoch end).

    Args:
        checkpoint_dir: where `ckpt-<global_step>` folders go.
        max_to_keep: how many recent checkpoints to keep.
        keep_checkpoint_every_n_hours: also keep, for good, one checkpoint
            per this many hours of training (None: none).
    """

    def __init__(self, checkpoint_dir, max_to_keep=10, keep_checkpoint_every_n_hours=None):
        super().__init__()
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"ModelSaver: max_to_keep must be >= 1; got {max_to_keep}.")
        self.checkpoint_dir = checkpoint_dir
        self.max_to_keep = max_to_keep
        self.keep_every_s = (
            None if keep_checkpoint_every_n_hours is None else keep_checkpoint_every_n_hours * 3600
        )
        self._last_kept_time = None
        self._kept_for_good = set()

    def _before_train(self):
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        if self._last_kept_time is None:
            self._last_kept_time = time.time()

    def _trigger(self):
        state = ResumeState.of(self.model).to_dict()
        path = checkpoint.write_checkpoint(self.checkpoint_dir, self.model, state)
        if self.keep_every_s is not None and state["time"] - self._last_kept_time >= self.keep_every_s:
            self._kept_for_good.add(path)
            self._last_kept_time = state["time"]
        self._prune()

    def _prune(self):
        if self.max_to_keep is None:
            return
        candidates = [p for _, p in checkpoint.list_checkpoints(self.checkpoint_dir)
                      if p not in self._kept_for_good]
        for path in candidates[: -self.max_to_keep]:
            shutil.rmtree(path, ignore_errors=True)


class _BestSaver(Callback):
    """Saves the model as `<filename>.keras` when triggered (by default, at
    every epoch end) and `stat` in the logs is a new best."""

    def __init__(self, stat, filename=None, checkpoint_dir=".", better=None):
        super().__init__()
        self.stat = stat
        self.filename = filename or f"{type(self).__name__.lower().replace('saver', '')}-{stat}"
        self.checkpoint_dir = checkpoint_dir
        self._better = better
        self.best = None

    @property
    def path(self):
        return os.path.join(self.checkpoint_dir, self.filename + ".keras")

    def _trigger(self):
        value = self.read_stat(self.logs, self.stat)
        if self.best is None or self._better(value, self.best):
            self.best = value
            os.makedirs(self.checkpoint_dir, exist_ok=True)
            staging = self.path + ".writing.keras"
            self.model.save(staging)
            os.replace(staging, self.path)


class MinSaver(_BestSaver):
    """Keeps the model with the lowest `stat` (an epoch-log key such as
    "val_loss") as `<checkpoint_dir>/<filename>.keras`."""

    def __init__(self, stat, filename=None, checkpoint_dir="."):
        super().__init__(stat, filename, checkpoint_dir, better=lambda new, best: new < best)


class MaxSaver(_BestSaver):
    """Keeps the model with the highest `stat` (e.g. "val_accuracy")."""

    def __init__(self, stat, filename=None, checkpoint_dir="."):
        super().__init__(stat, filename, checkpoint_dir, better=lambda new, best: new > best)


class AutoResume(Callback):
    """Restores the latest checkpoint in `checkpoint_dir` when fit starts.

    Like Keras's BackupAndRestore, but exact to the step: weights, optimizer
    slots, global_step, random-number states, epoch, step in the epoch, and
    the input position are restored, and training goes on as if it had never
    stopped (with deterministic ops and a deterministic input pipeline, the
    final weights are bit-equal to an uninterrupted run's). Pair it with a
    ModelSaver writing to the same directory. Without a checkpoint it does
    nothing.

    The input position is restored by skipping the batches each tower had
    taken, which replays the pipeline's work for them; when an epoch is one
    pass over finite data (no steps_per_epoch), training resumes at the start
    of the interrupted epoch instead.
    """

    def __init__(self, checkpoint_dir):
        super().__init__()
        self.checkpoint_dir = checkpoint_dir
        self.restored_from = None
        # Runs on every process, so the chief's restored state reaches all.
        self.chief_only = False

    def restore_training_state(self):
        """Restores the newest checkpoint into the model; returns its
        `ResumeState`, or None without one. The training loop calls it on
        the chief before `on_train_begin`, then broadcasts the variables and
        the state to every other process."""
        path = checkpoint.latest_checkpoint(self.checkpoint_dir)
        if path is None:
            return None
        state = ResumeState.from_dict(checkpoint.read_checkpoint(path, self.model))
        state.check_towers(self.model.num_towers)
        self.restored_from = path
        return state
