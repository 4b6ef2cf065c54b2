"""fit's input on JAX, opened: per-tower batches read ahead, calls launched ahead.

`FitFeed` is the JAX engine's `Feed` (backend/engine.py): it takes each
call's steps from the per-tower batches (one shape a call; a pass's short
last step runs alone), reads and places the next call's batches while a
call runs, launches that call ahead where the towers' steps allow
(`TowerSteps.launches_ahead`), counts what each call did, and, where no
callback reads a step (`Feed.flags_read_late`), leaves a call's finite
flags unread until the next call, gated on them, is launched
(`StepRun.settle`).
"""

import dataclasses

import jax
import keras
import numpy as np

from kerastower.backend.engine import Feed
from kerastower.backend.engine import StepRun
from kerastower.backend.jax import step as jax_step
from kerastower.errors import KerasTowerError
from kerastower.errors import StepFailedError
from kerastower.inputs.dealing import batch_words
from kerastower.inputs.dealing import failed_batch

__all__ = ["FitFeed"]


def _shapes(step):
    # JAX's leaves: a sparse batch's shape is its entries' too.
    return [[np.shape(leaf) for leaf in jax.tree.leaves(batch)] for batch in step]


def _naming_failures(steps, source):
    """The steps of `steps`, where an exception the input raised making a
    batch (marked by `dealing.numbered_steps`: generators, iterables,
    PyDatasets) becomes a StepFailedError naming its tower and its batch
    of the pass, as on TensorFlow (backend/tensorflow/step_errors.py),
    chained to the user's exception."""
    iterator = iter(steps)
    while True:
        try:
            step = next(iterator)
        except StopIteration:
            return
        except Exception as error:
            batch = failed_batch(error)
            if batch is None or not batch[1] or isinstance(error, KerasTowerError):
                raise
            kind = getattr(source, "kind", type(source).__name__)
            raise StepFailedError(
                f"Training failed on tower {batch[0] % batch[1]}: the input ({kind}) raised "
                f"{type(error).__name__}: {error} ({batch_words(batch)}). Fix the input; the "
                "exception is this error's cause."
            ) from error
        yield step


class FitFeed(Feed):
    """fit's per-tower batches on JAX, read ahead of the step where reading
    ahead cannot change them (arrays)."""

    def __init__(self, engine, source, steps_per_epoch, steps_per_call):
        self.engine = engine
        self.model = engine.model
        self.source = source
        self.steps_per_epoch = steps_per_epoch
        self.steps_per_call = steps_per_call

    @property
    def flags_read_late(self):
        return self.engine.flags_read_late

    @flags_read_late.setter
    def flags_read_late(self, value):
        # The engine's tower steps read it too (`TowerSteps.launches_ahead`).
        self.engine.flags_read_late = value

    def start(self, skip_batches, epoch_num):
        """Arrays and PyDatasets replay their pass's order from the seed and
        skip what was taken; a generator's batches are read and dropped.
        On JAX every tower counts the steps, so a step's batches are skipped
        whole."""
        self.endless = bool(self.steps_per_epoch)
        self._ahead = self._pending = self._launched = None
        self.flags_read_late = False  # until FitSteps asks the callbacks, at each epoch's start
        for tower_steps in self.engine.all_tower_steps():
            tower_steps.going = None  # a fit after a non-finite step trains again
        self._launching = True
        skip = max(skip_batches) if skip_batches else 0
        self.resumed_pass = None
        if self.endless:
            self.iterator = _naming_failures(
                self.engine.place(self.source, skip_batches=skip_batches), self.source)
        elif skip:
            self.resumed_pass = list(skip_batches)

    def begin_pass(self, loop):
        self.loop = loop
        if self.endless:
            return
        loop.tower_batches = [0] * self.model.num_towers
        self._ahead = self._pending = self._launched = None  # a new pass, a new iterator
        skip = 0
        if self.resumed_pass is not None:
            loop.tower_batches, self.resumed_pass = self.resumed_pass, None
            skip = max(loop.tower_batches)
        self.iterator = _naming_failures(
            self.engine.place(self.source, loop.epoch_num - 1, [skip]), self.source)

    def run(self, num_steps, loop):
        """Up to `num_steps` steps (`steps_per_execution`), in as few jitted
        calls as the input allows: one, unless a step of another shape (a
        pass's short last step) must run on its own."""
        self.loop = loop
        num_towers = self.model.num_towers
        run = StepRun(tower_batches=[0] * num_towers)
        while run.done < num_steps:
            steps, logs, finite = self._next_call(num_steps - run.done)
            if not steps:
                break
            run.logs = logs
            run.final_logs = self.engine.tower_steps(len(steps[0])).final_logs
            next_steps = self._next_call_steps(num_steps, run.done + len(steps))
            self._look_ahead(next_steps, len(steps[0]))
            if self.flags_read_late and finite is not None and self._next_call_gated(
                    next_steps, run.done + len(steps) >= num_steps, len(steps[0])):
                # Nothing reads these steps before the next call is made
                # (which they gate) or the epoch ends, so their flags are
                # read then (`FitSteps`): the host never waits for the
                # steps it just launched.
                settled = dataclasses.replace(run)

                def settle():
                    self._count(settled, steps, finite)
                    return settled

                self._count(run, steps, None)
                run.settle = settle
                return run
            if not self._count(run, steps, finite):
                break
        return run

    def _count(self, run, steps, finite):
        """Counts in `run` the steps of one call applied, as `finite` (their
        flags, waited for; None: all) says; False when one was not."""
        failed = jax_step.first_nonfinite_step(finite)  # waits for the steps
        done = len(steps) if failed is None else failed[0]
        # A failed step's batches were taken (the input's position, as on
        # TensorFlow); its update was not applied.
        taken = len(steps) if failed is None else done + 1
        num_towers = self.model.num_towers
        for batches in steps[:taken]:
            examples = [_examples(b) for b in batches]
            run.tower_batches = [n + 1 for n in run.tower_batches]
            run.examples += sum(examples)
            if run.tower_examples is None:
                run.tower_examples = examples * (num_towers // len(examples))
        run.done += done
        run.taken += taken
        if failed is None:
            return True
        run.nonfinite_towers = failed[1]
        self._launched = None  # it followed the failed call: dropped
        return False

    def _next_call_gated(self, next_steps, call_completes, num_towers):
        """Whether the call just launched may leave its flags unread: it
        runs the steps asked for, and either no step of this epoch follows
        (its length is reached, or reading ahead found the pass's end), or
        the next call is known to run on the same towers, which it gates
        (launched ahead, or its batches read ahead)."""
        if not call_completes:
            return False
        if next_steps < 1 or self._launched is not None:
            return True
        ahead = self._ahead
        return ahead is not None and (not ahead[0] or len(ahead[0][0]) == num_towers)

    def _next_call(self, most):
        """(the steps of the next call, their logs, their finite flags): the
        call launched ahead when it still starts from the towers' state,
        else a call launched now, of at most `most` steps."""
        launched, self._launched = self._launched, None
        if launched is not None:
            tower_steps = self.engine.tower_steps(len(launched.steps[0]))
            if launched.generation == tower_steps.generation():
                # Its outputs become the towers' state before its flags are
                # read: a non-finite call's outputs are its inputs.
                return (launched.steps, *tower_steps.commit(launched))
            # A callback set a variable (or the metrics were reset): the
            # launched steps run again from the variables, and no later
            # call is launched ahead in this fit (it would be lost again).
            self._ahead = (launched.steps, launched.placed)
            self._launching = False
        steps, placed = self._ahead or (self._take_steps(most), None)
        self._ahead = None
        if not steps:
            return [], None, None
        tower_steps = self.engine.tower_steps(len(steps[0]))
        # The last call's gate, where it ran on the same towers (a call
        # whose flags were left unread always has its next call there).
        return (steps, *self.engine.run_towers("train", steps, placed, going=tower_steps.going))

    def _look_ahead(self, num_steps, num_towers):
        """While the steps just launched run, the next call's batches are
        read and placed (`_read_ahead`) and, where the towers' steps
        allow (`TowerSteps.launches_ahead`), that call is launched too: the
        host's work between two steps (the loop, the callbacks) then
        overlaps the devices', as with the finite check off."""
        self._ahead = self._read_ahead(num_steps)
        if not self._ahead or not self._ahead[0] or len(self._ahead[0][0]) != num_towers:
            return
        tower_steps = self.engine.tower_steps(num_towers)
        if self._launching and tower_steps.launches_ahead():
            self._launched = tower_steps.launch(*self._ahead, going=tower_steps.going)
            self._ahead = None

    _pending = None  # a step taken from the input that must run in a call of its own
    _launched = None  # the next call's steps, launched ahead (`_look_ahead`)

    def _take_steps(self, most):
        """Up to `most` steps of the input to run in one call: steps of every
        tower and of one shape (a short last step runs alone)."""
        steps = []
        while len(steps) < most:
            step, self._pending = self._pending or next(self.iterator, None), None
            if step is None:
                break
            if steps and _shapes(step) != _shapes(steps[0]):
                self._pending = step
                break
            steps.append(step)
            if len(step) < self.model.num_towers:
                break
        return steps

    def _next_call_steps(self, num_steps, taken):
        """How many steps the next call runs, when known: the rest of this
        one, else the next `run`'s, within this epoch."""
        if taken < num_steps:
            return num_steps - taken
        if not self.steps_per_epoch:
            return self.steps_per_call
        return min(self.steps_per_call, self.steps_per_epoch - self.loop.local_step - taken)

    # While a step runs, the next call's batches are read and put on the
    # devices, from sources that reading ahead cannot change (arrays): a
    # generator or PyDataset is read only when its batches are due.
    _ahead = None

    def _read_ahead(self, num_steps):
        if num_steps < 1 or not getattr(self.source, "read_ahead", False):
            return None
        steps = self._take_steps(num_steps)
        if not steps:
            return ([], None)
        return steps, self.engine.tower_steps(len(steps[0])).place_steps(steps)


def _examples(batch):
    """The examples in one tower's batch: its first array's length."""
    if type(batch) is tuple and hasattr(batch[0], "shape"):
        return len(batch[0])  # (x, y, ...), x an array: no walk of the structure
    return len(keras.tree.flatten(batch)[0])
