"""Triggers: run another callback's `trigger()` on a schedule or a condition.

```python
import keras
import kerastower as kt

# Trigger every 100 steps and at the end of every 2nd epoch.
kt.callbacks.PeriodicTrigger(my_callback, every_k_steps=100, every_k_epochs=2)
# Run my_callback only while pred(my_callback) is true.
kt.callbacks.EnableCallbackIf(my_callback, lambda cb: cb.epoch_num > 3)
# Keras callbacks too: their trigger is their on_epoch_end.
kt.callbacks.PeriodicTrigger(keras.callbacks.ModelCheckpoint("ep{epoch}.keras"), every_k_epochs=5)
```

The wrapped callback does all its work when its wrapper says: a kt
callback's trigger gets the logs of the hook that fired it (`self.logs`),
so an InferenceRunner adds its results to them, a MinSaver reads them.

A Keras callback's trigger is its `on_epoch_end(epoch, logs)`, called with
the current 0-based epoch and the logs of the hook that fired it (the
step's logs when fired after a step). Its other hooks (`on_train_begin`,
`on_epoch_begin`, `on_train_batch_begin/end`, `on_test_*`, `on_predict_*`,
`on_train_end`) are forwarded; as unwrapped, its `on_train_end` runs only
when training completes, not when it fails.
"""

import keras

from kerastower.arguments import integer
from kerastower.callbacks.base import Callback
from kerastower.callbacks.base import KERAS_CHIEF_ONLY

__all__ = ["PeriodicTrigger", "EnableCallbackIf", "ProxyCallback"]

# Keras hooks with no template method: forwarded to the wrapped callback as they are.
_FORWARDED_HOOKS = (
    "on_test_begin",
    "on_test_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_begin",
    "on_predict_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
)
# kt hooks a wrapper splits into template methods it schedules.
_SCHEDULED_HOOKS = ("on_train_batch_end", "on_epoch_end")


def _checked(wrapper, callback):
    """`callback` if a wrapper can schedule it, else a TypeError saying why."""
    if not isinstance(callback, keras.callbacks.Callback):
        raise TypeError(
            f"{wrapper} wraps a kt.callbacks.Callback or a keras.callbacks.Callback; "
            f"got {type(callback).__name__}."
        )
    if isinstance(callback, Callback):
        for hook in _SCHEDULED_HOOKS:
            if getattr(type(callback), hook) is not getattr(Callback, hook):
                raise TypeError(
                    f"{wrapper}: {type(callback).__name__} overrides {hook}, whose work "
                    "a wrapper cannot schedule (it calls the template methods). Do that "
                    "work in _trigger() (or _trigger_step / _after_epoch / "
                    "_trigger_epoch), reading and updating self.logs."
                )
    return callback


class ProxyCallback(Callback):
    """Forwards every hook to the wrapped callback, a `kt.callbacks.Callback`
    or a `keras.callbacks.Callback` (see the module docstring).

    Subclasses choose when: `_active()` gates every hook but set-up and
    tear-down (`before_train`, `after_train`), and they may override the
    template methods, calling `super()` to forward.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> class OddEpochsOnly(kt.callbacks.ProxyCallback):
        ...     def _active(self):
        ...         return self.epoch_num % 2 == 1
        >>> printer = OddEpochsOnly(kt.callbacks.ScalarPrinter(["loss"]))
        >>> _ = model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[printer])
        [epoch 1, step 4] loss: ...
        [epoch 3, step 12] loss: ...
    """

    def __init__(self, callback):
        super().__init__()
        self.callback = _checked(type(self).__name__, callback)
        self.is_keras = not isinstance(callback, Callback)
        self.chief_only = getattr(callback, "chief_only", None)
        if self.chief_only is None:
            self.chief_only = isinstance(callback, KERAS_CHIEF_ONLY)
        self._run_active = True

    def _active(self):
        """Whether the wrapped callback's hooks run now (always, here)."""
        return True

    def set_model(self, model):
        super().set_model(model)
        self.callback.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        self.callback.set_params(params)

    def _wrapped(self):
        """The wrapped kt callback, given the logs of the running hook."""
        self.callback.logs = self.logs
        return self.callback

    def _keras_epoch_end(self):
        """A Keras callback's trigger: its on_epoch_end with the current logs."""
        logs = {} if self.logs is None else self.logs
        self.callback.on_epoch_end(self.epoch_num - 1, logs)

    def _keras_batch_end(self):
        """A Keras callback's on_train_batch_end: a hook besides its trigger."""
        if self.is_keras:
            self.callback.on_train_batch_end(self.local_step - 1, self.logs)

    # Keras hooks with no template method.

    def on_train_batch_begin(self, batch, logs=None):
        super().on_train_batch_begin(batch, logs)
        if self._active():
            self.callback.on_train_batch_begin(batch, logs)

    # Template methods -> the wrapped callback.

    def _before_train(self):
        self.callback.on_train_begin(self.logs)

    def _before_epoch(self):
        if self._active():
            self.callback.on_epoch_begin(self.epoch_num - 1, self.logs)

    def _before_run(self):
        # The pair of hooks runs or not together, as pred said before the run.
        self._run_active = self._active()
        if self._run_active and not self.is_keras:
            self._wrapped().before_run()

    def _after_run(self, outputs):
        if self._run_active and not self.is_keras:
            self._wrapped().after_run(outputs)

    def _trigger_step(self):
        if self._active():
            self._keras_batch_end()
            if not self.is_keras:
                self._wrapped().trigger_step()

    def _after_epoch(self):
        if self._active() and not self.is_keras:
            self._wrapped().after_epoch()

    def _trigger_epoch(self):
        if self._active():
            if self.is_keras:
                self._keras_epoch_end()
            else:
                self._wrapped().trigger_epoch()

    def _trigger(self):
        if self._active():
            if self.is_keras:
                self._keras_epoch_end()
            else:
                self._wrapped().trigger()

    def _after_train(self):
        # The loop marks a failed run: to Keras, on_train_end means success.
        if not (self.is_keras and self.loop.training_failed):
            self.callback.on_train_end(self.logs)

    def __str__(self):
        return f"{type(self).__name__}({self.callback})"


def _forwarding(hook):
    def forward(self, *args, **kwargs):
        if self._active():
            getattr(self.callback, hook)(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = hook
    forward.__doc__ = f"Calls the wrapped callback's `{hook}` while it is active."
    return forward


for _hook in _FORWARDED_HOOKS:
    setattr(ProxyCallback, _hook, _forwarding(_hook))


class PeriodicTrigger(ProxyCallback):
    """Triggers `callback` every k steps and/or every k epochs.

    Only the trigger is scheduled: the wrapped callback's other hooks
    (`_before_train`, `_before_epoch`, `_after_epoch`, `_after_train`, and a
    Keras callback's hooks but `on_epoch_end`) still run every time, and its
    own `_trigger_step` / `_trigger_epoch` do not. A trigger after a step
    gets that step's logs; one at an epoch end gets the epoch's logs.

    Args:
        callback: a `kt.callbacks.Callback`, triggered with `trigger()`, or a
            `keras.callbacks.Callback`, triggered with `on_epoch_end`.
        every_k_steps: trigger after global steps divisible by k (an int,
            numpy ints too).
        every_k_epochs: trigger at the end of epochs divisible by k.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> import os
        >>> every_2_steps = kt.callbacks.PeriodicTrigger(kt.callbacks.ModelSaver("ckpt"), every_k_steps=2)
        >>> _ = model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[every_2_steps])
        >>> sorted(os.listdir("ckpt"))
        ['ckpt-00000002', 'ckpt-00000004']
    """

    def __init__(self, callback, every_k_steps=None, every_k_epochs=None):
        super().__init__(callback)
        if every_k_steps is None and every_k_epochs is None:
            raise ValueError("PeriodicTrigger needs every_k_steps or every_k_epochs (or both).")
        # numpy integers count as ints; a bool, float or str raises ArgumentError.
        self.every_k_steps = integer(every_k_steps, "every_k_steps", "PeriodicTrigger",
                                     minimum=1, none_ok=True)
        self.every_k_epochs = integer(every_k_epochs, "every_k_epochs", "PeriodicTrigger",
                                      minimum=1, none_ok=True)
        self._last_seen_step = 0
        self._last_triggered_step = None

    def _before_train(self):
        self._last_seen_step = self.global_step
        super()._before_train()

    def _trigger_step(self):
        self._keras_batch_end()
        if self.every_k_steps is None:
            return
        step, k = self.global_step, self.every_k_steps
        # With steps_per_execution > 1 the hook sees some steps only: fire when
        # a multiple of k was reached since the last time it ran.
        crossed = step // k > self._last_seen_step // k
        self._last_seen_step = step
        if crossed:
            self._last_triggered_step = step
            self._trigger()

    def _trigger_epoch(self):
        # An epoch end that falls on a step trigger fires once, not twice.
        if (
            self.every_k_epochs is not None
            and self.epoch_num % self.every_k_epochs == 0
            and self._last_triggered_step != self.global_step
        ):
            self._last_triggered_step = self.global_step
            self._trigger()


class EnableCallbackIf(ProxyCallback):
    """Runs the hooks of `callback` only while `pred(callback)` is true.

    As in tensorpack, set-up and tear-down run whatever `pred` says: a kt
    callback's `_before_train` / `_after_train`, a Keras callback's
    `on_train_begin` / `on_train_end` (where e.g. CSVLogger opens and closes
    its file). Every other hook, triggers included, runs only while `pred`
    is true; `pred` is evaluated before each, so a callback can be enabled
    after some epoch or disabled when a value is reached. `_before_run` and
    `_after_run` run as a pair, as `pred` said before the run.

    Args:
        callback: a `kt.callbacks.Callback` or a `keras.callbacks.Callback`
            (whose trigger is its `on_epoch_end`).
        pred: `pred(callback)` -> bool.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> printer = kt.callbacks.ScalarPrinter(["loss"])
        >>> from_epoch_2 = kt.callbacks.EnableCallbackIf(printer, lambda callback: callback.epoch_num >= 2)
        >>> _ = model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[from_epoch_2])
        [epoch 2, step 8] loss: ...
        [epoch 3, step 12] loss: ...
    """

    def __init__(self, callback, pred):
        super().__init__(callback)
        if not callable(pred):
            raise TypeError(f"EnableCallbackIf: pred must be callable; got {pred!r}.")
        self.pred = pred

    def _active(self):
        return bool(self.pred(self.callback))
