"""`kt.callbacks.Callback`: tensorpack's callback template as a Keras callback.

Subclasses override the private template methods; Keras calls the public
`on_*` hooks, which call them. It is a `keras.callbacks.Callback`, so one
`callbacks=[...]` list can mix it with any Keras callback.

| tensorpack method | runs | called from Keras hook |
|---|---|---|
| `_before_train()` | once, before the first step | `on_train_begin` |
| `_before_epoch()` | at the start of every epoch | `on_epoch_begin` |
| `_before_run()` | before every hooked run (see below) | the trainer's hooked path |
| `_after_run(outputs)` | after every hooked run, with what it returned | the trainer's hooked path |
| `_trigger_step()` | after every step (every k steps with `steps_per_execution=k`) | `on_train_batch_end` |
| `_after_epoch()` | at the end of every epoch, before `_trigger_epoch` | `on_epoch_end` |
| `_trigger_epoch()` | at the end of every epoch; default: `_trigger()` | `on_epoch_end` |
| `_trigger()` | whenever the callback is triggered | `trigger()` |
| `_after_train()` | once, when training ends | `on_train_end` |

A *hooked run* is a call made through the trainer's hooked path: in `fit`,
every call of the compiled step function (its outputs are the step's logs);
under `kt.Trainer`, every `trainer.hooked_run(fn, ...)` (its outputs are what
`fn` returned). A plain call, made directly, triggers neither hook.

`self.logs` is the logs dict of the Keras hook that is running: the epoch's
logs in `_after_epoch`, `_trigger_epoch` and an epoch-end `_trigger`, the
step's logs in `_trigger_step` and a `_trigger` fired after a step. It is
the dict Keras passes on to the callbacks after this one, so results added
to it (`self.logs["val_loss"] = ...`) reach History, CSVLogger, etc. Do a
callback's work in the template methods, not in overridden `on_*` hooks:
wrappers (`PeriodicTrigger`, `EnableCallbackIf`) schedule the template
methods, and give the wrapped callback their own hook's logs.

```python
import kerastower as kt

class SayEpoch(kt.callbacks.Callback):
    def _trigger(self):
        print("epoch", self.epoch_num, "global step", self.global_step)
```
"""

import keras

__all__ = ["Callback", "KERAS_CHIEF_ONLY", "RunAware", "RunHooks", "unwrapped"]


class RunAware:
    """A callback the training loop hands its run to, when the run begins.

    kerastower's callbacks, those built on Keras's too (its TensorBoard and
    progress bar), read the loop's counters from `training_run` (a
    `kerastower.loop.run.TrainingRun`), not through `self.model`: on JAX,
    Keras's `Callback.model` first writes the towers' weights into the
    model's variables, which a counter does not need.
    """

    training_run = None  # the TrainingRun that calls this callback (loop/run.py)

    def set_training_run(self, run):
        """Called by the loop when a training run that calls this callback begins."""
        self.training_run = run

    @property
    def loop(self):
        """The `kt.LoopState` of the training run (else the model's, outside one)."""
        run = self.training_run
        return self.model.loop if run is None else run.state


class Callback(RunAware, keras.callbacks.Callback):
    """Base class of kerastower's callbacks; see the module docstring.

    Attributes:
        chief_only: True (the default) runs the callback on the chief process
            only when training spans several processes (Horovod, multi-worker):
            the one that writes logs and checkpoints.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> class SayEpoch(kt.callbacks.Callback):
        ...     def _trigger(self):
        ...         print("epoch", self.epoch_num, "global step", self.global_step)
        >>> _ = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[SayEpoch()])
        epoch 1 global step 4
        epoch 2 global step 8
    """

    chief_only = True
    logs = None  # the logs of the Keras hook that is running

    # Training state: the counters of the run that calls the callback.

    @property
    def epoch_num(self):
        return self.loop.epoch_num

    @property
    def global_step(self):
        return self.loop.global_step

    @property
    def local_step(self):
        return self.loop.local_step

    def read_stat(self, logs, stat):
        """The value of `stat` in the epoch `logs`, or a KeyError naming the
        keys there are."""
        logs = logs or {}
        if stat not in logs:
            raise KeyError(
                f"{type(self).__name__} watches {stat!r}, which is not in the "
                f"epoch logs {sorted(logs)}. Put it after the callback that adds it."
            )
        return float(logs[stat])

    # Keras hooks -> tensorpack template methods, with the hook's logs.

    def on_train_begin(self, logs=None):
        self.logs = logs
        self.before_train()

    def on_epoch_begin(self, epoch, logs=None):
        self.logs = logs
        self.before_epoch()

    def on_train_batch_begin(self, batch, logs=None):
        self.logs = logs

    def on_train_batch_end(self, batch, logs=None):
        self.logs = logs
        self.trigger_step()

    def on_epoch_end(self, epoch, logs=None):
        self.logs = logs
        self.after_epoch()
        self.trigger_epoch()

    def on_train_end(self, logs=None):
        self.logs = logs
        self.after_train()

    # Public methods, each calling its template method.

    def before_train(self):
        self._before_train()

    def before_epoch(self):
        self._before_epoch()

    def before_run(self):
        self._before_run()

    def after_run(self, outputs):
        self._after_run(outputs)

    def trigger_step(self):
        self._trigger_step()

    def after_epoch(self):
        self._after_epoch()

    def trigger_epoch(self):
        self._trigger_epoch()

    def trigger(self):
        self._trigger()

    def after_train(self):
        self._after_train()

    # Template methods for subclasses.

    def _before_train(self):
        pass

    def _before_epoch(self):
        pass

    def _before_run(self):
        pass

    def _after_run(self, outputs):
        pass

    def _trigger_step(self):
        pass

    def _after_epoch(self):
        pass

    def _trigger_epoch(self):
        self._trigger()

    def _trigger(self):
        pass

    def _after_train(self):
        pass

    def __str__(self):
        return type(self).__name__


# Keras's callbacks that write files or print: they count as chief-only
# (`Callback.chief_only`), as kerastower's own do by default.
KERAS_CHIEF_ONLY = (
    keras.callbacks.TensorBoard,
    keras.callbacks.ModelCheckpoint,
    keras.callbacks.CSVLogger,
    keras.callbacks.ProgbarLogger,
)


class RunHooks:
    """The hooked path: calls `before_run()` and `after_run(outputs)` of the
    kt callbacks in `callbacks` around a run.

    Args:
        callbacks: a list or `keras.callbacks.CallbackList`; Keras callbacks
            in it have no such hooks and are left out.
    """

    def __init__(self, callbacks):
        callbacks = getattr(callbacks, "callbacks", callbacks) or []
        self.callbacks = [cb for cb in callbacks if isinstance(cb, Callback)]

    def before_run(self):
        for callback in self.callbacks:
            callback.before_run()

    def after_run(self, outputs):
        for callback in self.callbacks:
            callback.after_run(outputs)

    def __call__(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)`, between the hooks; returns its outputs."""
        self.before_run()
        outputs = fn(*args, **kwargs)
        self.after_run(outputs)
        return outputs


def unwrapped(callback):
    """The callback a wrapper (PeriodicTrigger, EnableCallbackIf) holds."""
    while hasattr(callback, "callback") and isinstance(callback, Callback):
        callback = callback.callback
    return callback
