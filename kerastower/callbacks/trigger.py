"""Triggers: run another callback's `trigger()` on a schedule or a condition.

```python
import kerastower as kt

# Trigger every 100 steps and at the end of every 2nd epoch.
kt.callbacks.PeriodicTrigger(my_callback, every_k_steps=100, every_k_epochs=2)
# Run my_callback only while pred(my_callback) is true.
kt.callbacks.EnableCallbackIf(my_callback, lambda cb: cb.epoch_num > 3)
```
"""

from kerastower.callbacks.base import Callback

__all__ = ["PeriodicTrigger", "EnableCallbackIf", "ProxyCallback"]


class ProxyCallback(Callback):
    """Forwards every hook to the wrapped `kt.callbacks.Callback`."""

    def __init__(self, callback):
        super().__init__()
        if not isinstance(callback, Callback):
            raise TypeError(
                f"{type(self).__name__} wraps a kt.callbacks.Callback; got "
                f"{type(callback).__name__}. Wrap a Keras callback in a "
                "kt.callbacks.Callback subclass that calls it from _trigger()."
            )
        self.callback = callback
        self.chief_only = callback.chief_only

    def set_model(self, model):
        super().set_model(model)
        self.callback.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        self.callback.set_params(params)

    def _before_train(self):
        self.callback.before_train()

    def _before_epoch(self):
        self.callback.before_epoch()

    def _before_run(self):
        self.callback.before_run()

    def _after_run(self, outputs):
        self.callback.after_run(outputs)

    def _trigger_step(self):
        self.callback.trigger_step()

    def _after_epoch(self):
        self.callback.after_epoch()

    def _trigger_epoch(self):
        self.callback.trigger_epoch()

    def _trigger(self):
        self.callback.trigger()

    def _after_train(self):
        self.callback.after_train()

    def __str__(self):
        return f"{type(self).__name__}({self.callback})"


class PeriodicTrigger(ProxyCallback):
    """Calls `callback.trigger()` every k steps and/or every k epochs.

    Only the trigger is scheduled: the wrapped callback's other hooks
    (`_before_train`, `_before_epoch`, `_after_epoch`, `_after_train`) still
    run every time, and its own `_trigger_step` / `_trigger_epoch` do not.

    Args:
        callback: a `kt.callbacks.Callback`.
        every_k_steps: trigger after global steps divisible by k.
        every_k_epochs: trigger at the end of epochs divisible by k.
    """

    def __init__(self, callback, every_k_steps=None, every_k_epochs=None):
        super().__init__(callback)
        for name, value in (("every_k_steps", every_k_steps), ("every_k_epochs", every_k_epochs)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"PeriodicTrigger: {name} must be a positive int; got {value!r}.")
        if every_k_steps is None and every_k_epochs is None:
            raise ValueError("PeriodicTrigger needs every_k_steps or every_k_epochs (or both).")
        self.every_k_steps = every_k_steps
        self.every_k_epochs = every_k_epochs
        self._last_seen_step = 0
        self._last_triggered_step = None

    def _before_train(self):
        self._last_seen_step = self.global_step
        super()._before_train()

    def _trigger_step(self):
        if self.every_k_steps is None:
            return
        step, k = self.global_step, self.every_k_steps
        # With steps_per_execution > 1 the hook sees some steps only: fire when
        # a multiple of k was reached since the last time it ran.
        crossed = step // k > self._last_seen_step // k
        self._last_seen_step = step
        if crossed:
            self._last_triggered_step = step
            self.callback.trigger()

    def _trigger_epoch(self):
        # An epoch end that falls on a step trigger fires once, not twice.
        if (
            self.every_k_epochs is not None
            and self.epoch_num % self.every_k_epochs == 0
            and self._last_triggered_step != self.global_step
        ):
            self._last_triggered_step = self.global_step
            self.callback.trigger()


class EnableCallbackIf(ProxyCallback):
    """Runs every hook of `callback` only while `pred(callback)` is true.

    `pred` is evaluated before each hook, so a callback can be enabled after
    some epoch or disabled when a value is reached.
    """

    def __init__(self, callback, pred):
        super().__init__(callback)
        if not callable(pred):
            raise TypeError(f"EnableCallbackIf: pred must be callable; got {pred!r}.")
        self.pred = pred

    def _enabled(self):
        return bool(self.pred(self.callback))

    def _before_train(self):
        if self._enabled():
            super()._before_train()

    def _before_epoch(self):
        if self._enabled():
            super()._before_epoch()

    def _before_run(self):
        if self._enabled():
            super()._before_run()

    def _after_run(self, outputs):
        if self._enabled():
            super()._after_run(outputs)

    def _trigger_step(self):
        if self._enabled():
            super()._trigger_step()

    def _after_epoch(self):
        if self._enabled():
            super()._after_epoch()

    def _trigger_epoch(self):
        if self._enabled():
            super()._trigger_epoch()

    def _trigger(self):
        if self._enabled():
            super()._trigger()

    def _after_train(self):
        if self._enabled():
            super()._after_train()
