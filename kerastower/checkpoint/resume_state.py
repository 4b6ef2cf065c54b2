"""What a resumed run needs besides the variables: `ResumeState`.

A checkpoint (kerastower/checkpoint/store.py) holds the variables and this state,
as `state.json`. AutoResume reads both on the chief; the loop broadcasts
them to every process, then goes on from `start_position`.
"""

import dataclasses
import time

from kerastower.errors import KerasTowerError

__all__ = ["ResumeState", "ElasticMove"]


@dataclasses.dataclass
class ResumeState:
    """Where training was when a checkpoint was written.

    Attributes:
        epoch_num: the epoch (1-based) the checkpoint was written in.
        local_step: steps done in that epoch.
        global_step: steps done in all.
        steps_per_epoch: the epoch length then (None: one pass of unknown length).
        tower_batches: batches each tower had taken from the input (the
            input position), since the current pass began.
        num_towers: the number of towers then.
        epoch_ended: whether it was written after the epoch's last step
            (at its end), so that a resume starts the next one.
        one_pass: whether an epoch was one pass over the input (no
            steps_per_epoch); `tower_batches` then count from the pass's start.
        batch_size: examples in each tower's batch when the input was numpy
            arrays (fit's `batch_size`); None when the source made its own
            batches (tower_batches then count those).
        array_order: what ordered shuffled numpy arrays' passes
            (`inputs/keras_order.py`, `order_kind`): "keras-tensorflow",
            "keras-jax" (stock Keras's order on that backend, seeded by
            `keras.utils.set_random_seed`), "seeded" (kerastower's own), or
            None (not shuffled arrays).
        time: when it was written (seconds since the epoch).
        callbacks: the run's callbacks' states, by callback, as JSON
            (kerastower/callbacks/carried_state.py; the numpy arrays they
            hold are the checkpoint's `callback_arrays.npz`), or None.
    """

    epoch_num: int
    local_step: int
    global_step: int
    steps_per_epoch: int = None
    tower_batches: list = dataclasses.field(default_factory=list)
    num_towers: int = 1
    epoch_ended: bool = False
    one_pass: bool = False
    batch_size: int = None
    array_order: str = None
    time: float = 0.0
    callbacks: dict = None

    @classmethod
    def of(cls, loop, num_towers):
        """The position of a training run now: its `LoopState`, on `num_towers` towers."""
        return cls(
            epoch_num=loop.epoch_num,
            local_step=loop.local_step,
            global_step=loop.global_step,
            steps_per_epoch=loop.steps_per_epoch,
            tower_batches=list(loop.tower_batches),
            num_towers=num_towers,
            epoch_ended=loop.epoch_ended,
            one_pass=loop.one_pass,
            batch_size=loop.batch_size,
            array_order=loop.array_order,
            time=time.time(),
        )

    @classmethod
    def from_dict(cls, values):
        names = {field.name for field in dataclasses.fields(cls)}
        missing = {"epoch_num", "local_step", "global_step"} - set(values)
        if missing:
            raise KerasTowerError(
                f"The checkpoint's state lacks {sorted(missing)}; got {sorted(values)}."
            )
        return cls(**{k: v for k, v in values.items() if k in names})

    def to_dict(self):
        return dataclasses.asdict(self)

    def total_batch(self):
        """Examples in one step then, or None when the source batched itself."""
        return None if self.batch_size is None else self.batch_size * self.num_towers

    def on_towers(self, num_towers, batch_size):
        """This position as `num_towers` towers taking batches of
        `batch_size` examples (None: the source's own batches) would hold
        it: an `ElasticMove` (the same state when nothing changed).

        The input position is kept in examples where both runs read numpy
        arrays (the position in the pass is `sum(tower_batches) x
        batch_size`), else in the source's batches. Towers take whole steps,
        so a position that is not a whole number of the new steps goes back
        to the step before it (those examples are read again).
        """
        if num_towers == self.num_towers and (
                batch_size == self.batch_size or None in (batch_size, self.batch_size)):
            # The same towers: the position counts batches, as it always did
            # (checkpoints of older versions do not record a batch size).
            return ElasticMove(self, self, num_towers, batch_size, 0)
        unit = 1 if batch_size is None or self.batch_size is None else batch_size
        taken = sum(self.tower_batches) * (1 if unit == 1 else self.batch_size)
        steps, again = divmod(taken, num_towers * unit)
        moved = dataclasses.replace(self, num_towers=num_towers, batch_size=batch_size,
                                    tower_batches=[steps] * num_towers if taken else [])
        if self.one_pass and not self.epoch_ended:
            moved.local_step = steps
        return ElasticMove(self, moved, num_towers, batch_size, again)

    def start_position(self, steps_per_epoch):
        """(epoch_num, first step, batches each tower skips) to go on from.

        With `steps_per_epoch` as when written: the next step of the same
        epoch, or the next epoch when that one had ended. With another epoch
        length: the next epoch, keeping the input position. When an epoch is
        one pass over the data (steps_per_epoch None, then and now): the next
        step of the interrupted pass, skipping the batches each tower took in
        it, or the next epoch if the pass had ended. Switching between the
        two kinds of epoch starts the next epoch on a fresh input.
        """
        skip = list(self.tower_batches) if any(self.tower_batches) else None
        if (steps_per_epoch is None) != self.one_pass:
            return self.epoch_num + 1, 0, None
        if steps_per_epoch is None:
            if self.epoch_ended:
                return self.epoch_num + 1, 0, None
            return self.epoch_num, self.local_step, skip
        if self.steps_per_epoch != steps_per_epoch or self.local_step >= steps_per_epoch:
            return self.epoch_num + 1, 0, skip
        return self.epoch_num, self.local_step, skip


class ElasticMove:
    """A resume on another number of towers or batch size: the position
    then (`saved`), as this run holds it (`state`), and what it changes.

    Attributes:
        same_total_batch: whether a step takes as many examples as then
            (known where both runs read numpy arrays; False otherwise,
            unless nothing changed).
        read_again: examples (or, for a source that batches itself, its
            batches) of the pass read a second time, because the saved
            position is not a whole number of this run's steps.
    """

    def __init__(self, saved, state, num_towers, batch_size, read_again):
        self.saved = saved
        self.state = state
        self.read_again = read_again
        self.changed = saved is not state
        now = None if batch_size is None else batch_size * num_towers
        self.same_total_batch = not self.changed or (now is not None and now == saved.total_batch())

    @property
    def exact(self):
        """Whether the resumed run takes exactly what the uninterrupted one would."""
        return self.same_total_batch and not self.read_again

    def describe(self):
        """The start line's account of what changed, or "" when nothing did."""
        if not self.changed:
            return ""
        saved, state = self.saved, self.state

        def steps(towers, batch):
            if batch is None:
                return f"{towers} tower(s) x the source's batch"
            return f"{towers} tower(s) x {batch} = total batch {towers * batch}"

        in_examples = saved.batch_size is not None and state.batch_size is not None
        unit = "example" if in_examples else "source batch"
        taken = sum(state.tower_batches) * (state.batch_size if in_examples else 1)
        text = (f"The checkpoint was written by {steps(saved.num_towers, saved.batch_size)}; "
                f"this run has {steps(state.num_towers, state.batch_size)}")
        if self.same_total_batch:
            text += ": the same total batch"
        else:
            text += (": another total batch (weights, optimizer state and step are restored; "
                     "training from here differs from the uninterrupted run's)")
        if any(saved.tower_batches):
            text += f". The input goes on at {unit} {taken} of the pass"
            if not in_examples:
                text += (" (the source's batches are counted: if they now hold another "
                         "number of examples, the position moved with them)")
            if self.read_again:
                text += (f" ({self.read_again} {unit}(s) after it were taken before the "
                         "checkpoint: not a whole step of this run, they are read again)")
        return text + "."
