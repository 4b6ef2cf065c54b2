"""The one training loop that `fit` and `kt.Trainer` share.

`main_loop.py` runs epochs as callback periods and schedules every callback
(`MainLoop`, `LoopState`, `Iteration`); `fit_steps.py` is what one
iteration of `fit` is; `resume.py` what makes a run survive (folder locks,
the restore at start, the stop on a preemption signal, `preemption.py`).
"""

from kerastower.loop.main_loop import Iteration
from kerastower.loop.main_loop import LoopState
from kerastower.loop.main_loop import MainLoop
from kerastower.loop.main_loop import StopTraining
from kerastower.loop.main_loop import training_callbacks

__all__ = ["LoopState", "MainLoop", "Iteration", "StopTraining", "training_callbacks"]
