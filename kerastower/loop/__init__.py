"""The one training loop that `fit` and `kt.Trainer` share.

`main_loop.py` runs epochs as callback periods and schedules every callback
(`MainLoop`, `LoopState`, `Iteration`), and `batch_hooks.py` which of an
epoch's steps reach the callbacks' batch hooks (every one, unless a lone
progress bar is handed only the steps it may draw); `fit_steps.py` is what
one iteration of `fit` is; `inference_loops.py` evaluate's and predict's
loops; `single_batch.py` the `*_on_batch` methods; `run.py` one call of
fit or `kt.Trainer.train` as the loop owns it (`TrainingRun`); `resume.py`
what makes a run survive (folder locks, the restore at start, the stop on
a preemption signal, `preemption.py`).
"""

from kerastower.loop.main_loop import Iteration
from kerastower.loop.main_loop import LoopState
from kerastower.loop.main_loop import MainLoop
from kerastower.loop.main_loop import StopTraining
from kerastower.loop.main_loop import training_callbacks

__all__ = ["LoopState", "MainLoop", "Iteration", "StopTraining", "training_callbacks"]
