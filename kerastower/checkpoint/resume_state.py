"""What a resumed run needs besides the variables: `ResumeState`.

A checkpoint (kerastower/checkpoint/store.py) holds the variables and this state,
as `state.json`. AutoResume reads both on the chief; the loop broadcasts
them to every process, then goes on from `start_position`.
"""

import dataclasses
import time

from kerastower.errors import KerasTowerError

__all__ = ["ResumeState"]


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
        time: when it was written (seconds since the epoch).
    """

    epoch_num: int
    local_step: int
    global_step: int
    steps_per_epoch: int = None
    tower_batches: list = dataclasses.field(default_factory=list)
    num_towers: int = 1
    epoch_ended: bool = False
    one_pass: bool = False
    time: float = 0.0

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

    def check_towers(self, num_towers):
        if self.num_towers != num_towers and any(self.tower_batches):
            raise KerasTowerError(
                f"The checkpoint was written by {self.num_towers} towers; this run has "
                f"{num_towers}, so the input position cannot be restored. Resume with "
                "the same number of towers."
            )

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
