"""`TrainingRun`: one call of `fit` or `kt.Trainer.train`, as the loop owns it.

The loop (`MainLoop`, main_loop.py) trains through a run: its counters
(`state`, a `LoopState`), the step engine that runs the towers' steps
(`engine`), the callbacks it schedules and the strategy that places,
reduces and broadcasts. While the run trains, the callbacks read the
loop's counters from it (`kt.callbacks.Callback.training_run`), a
checkpoint records its `state`, and `model.loop` is that state: the
model's own counters under `fit`, the trainer's under `kt.Trainer`.

```python
import keras, numpy as np, kerastower as kt

class SayStep(kt.callbacks.Callback):
    def _trigger_epoch(self):
        run = self.training_run            # the run that calls this callback
        print(run.name, run.state.global_step)

inputs = keras.Input((3,))
model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
model.compile(optimizer="sgd", loss="mse")
model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0,
          callbacks=[SayStep()])           # prints: fit 2
```
"""

import contextlib

from kerastower.callbacks.base import Callback as KtCallback
from kerastower.callbacks.base import RunAware

__all__ = ["TrainingRun"]


class TrainingRun:
    """One training run: the loop's state, its engine, callbacks and strategy.

    Args:
        model: the `kt.TowerModel` trained (a kt.Trainer's model).
        state: the `kt.LoopState` the run counts in: the model's own for
            `fit` (it goes on across calls), the trainer's for `kt.Trainer`.
        name: who runs it ("fit", or the trainer's class name), for messages.

    Attributes:
        callbacks: the `keras.callbacks.CallbackList` the loop calls, set
            inside `training()` (callbacks set up there see the run's state
            as `model.loop`).
        engine: the model's step engine (`kerastower.backend.engine.StepEngine`).
        strategy: the `kt.TowerStrategy` the model was created under.
        restored_from: the checkpoint this run resumed from, or None.

    Examples:
        >>> class Watch(kt.callbacks.Callback):
        ...     def _after_train(self):
        ...         print(self.training_run.name, self.training_run.state.global_step)
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> _ = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0,
        ...               callbacks=[Watch()])
        fit 2
    """

    def __init__(self, model, state, name):
        self.model = model
        self.state = state
        self.callbacks = None
        self.name = name
        self.engine = model.engine
        self.strategy = model.tower_strategy
        self.restored_from = None
        self._deferred = None  # the writes asked for inside `callback_pass`, else None

    def watchers(self):
        """The callbacks that take the run (`set_training_run`), wrapped ones included."""
        found = []
        for callback in getattr(self.callbacks, "callbacks", self.callbacks) or []:
            while callback is not None:
                if isinstance(callback, RunAware):
                    found.append(callback)
                callback = getattr(callback, "callback", None) if isinstance(callback, KtCallback) else None
        return found

    def hand_to_callbacks(self):
        """Gives the run to every callback that takes it (the loop does, at start)."""
        for callback in self.watchers():
            callback.set_training_run(self)

    @contextlib.contextmanager
    def callback_pass(self):
        """Around the callbacks' epoch-end hooks: a checkpoint asked for
        inside (`when_callbacks_done`) is written once every callback's
        hook has run, so that it holds what all of them did at that epoch's
        end (ReduceLROnPlateau's new rate, EarlyStopping's count)."""
        self._deferred = []
        try:
            yield
            deferred = self._deferred
        finally:
            self._deferred = None
        for write in deferred:
            write()

    def when_callbacks_done(self, write):
        """Runs `write` after the callbacks' current `callback_pass`, or now outside one."""
        if self._deferred is None:
            write()
        else:
            self._deferred.append(write)

    @contextlib.contextmanager
    def training(self):
        """Within it the run trains the model: `model.loop` is the run's state."""
        previous = self.model.training_run
        self.model.training_run = self
        try:
            yield self
        finally:
            self.model.training_run = previous

    def __repr__(self):
        return f"TrainingRun({self.name!r}, {self.state!r})"
