"""Hyper-parameter setters: change a variable of the optimizer or the model
as training goes, the same on every tower.

```python
import kerastower as kt

kt.callbacks.ScheduledHyperParamSetter("learning_rate", [(1, 0.1), (10, 0.01), (20, 0.001)])
kt.callbacks.ScheduledHyperParamSetter("learning_rate", [(1, 0.0), (5, 0.1)], interp="linear")
kt.callbacks.HyperParamSetterWithFunc("learning_rate", lambda epoch, lr: lr * 0.9)
kt.callbacks.StatMonitorParamSetter("learning_rate", "val_loss", lambda lr: lr / 2,
                                    threshold=0.0, last_k=3)
```

A param is named by a string: an attribute of the optimizer
(`"learning_rate"`), an attribute of the model holding a `keras.Variable`
(`"dropout_rate"` for `model.dropout_rate = keras.Variable(0.5)`), or a
dotted path from the model (`"g_optimizer.learning_rate"` for a GAN). A
`keras.Variable` may also be passed directly. Only variables can change
after the step is compiled: a plain Python number (e.g. Adam's `beta_1`) is
baked into the traced step, so naming one raises an error that says so.
"""

import keras
import numpy as np

from kerastower.arguments import integer
from kerastower.callbacks.base import Callback

__all__ = [
    "HyperParamSetter",
    "ScheduledHyperParamSetter",
    "HyperParamSetterWithFunc",
    "StatMonitorParamSetter",
]


def _find_variable(model, param):
    if isinstance(param, keras.Variable):
        return param
    if not isinstance(param, str):
        raise TypeError(f"A hyper-parameter is a name or a keras.Variable; got {param!r}.")
    if "." in param:
        # "g_optimizer.learning_rate": an attribute of something the model holds.
        path, param = param.rsplit(".", 1)
        owner = model
        for name in path.split("."):
            owner = getattr(owner, name, None)
        owners = [(path, owner)]
    else:
        owners = [("optimizer", getattr(model, "optimizer", None)), ("model", model)]
    inner = getattr(owners[0][1], "inner_optimizer", None)
    if inner is not None:
        owners.insert(1, (f"{owners[0][0]}.inner_optimizer", inner))
    for owner_name, owner in owners:
        if owner is None or not hasattr(owner, param):
            continue
        value = getattr(owner, param)
        # Keras optimizers expose learning_rate as a property over `_learning_rate`.
        is_optimizer = isinstance(owner, keras.optimizers.Optimizer)
        variable = getattr(owner, "_" + param, value) if is_optimizer else value
        if isinstance(variable, keras.Variable):
            return variable
        if isinstance(variable, keras.optimizers.schedules.LearningRateSchedule):
            raise ValueError(
                f"{owner_name}.{param} is a LearningRateSchedule, which sets it "
                "every step already; give the optimizer a number to schedule it "
                "with a callback."
            )
        raise ValueError(
            f"{owner_name}.{param} is {value!r}, a Python value baked into the "
            "compiled step: changing it would have no effect. Only variables "
            "can be scheduled: the optimizer's learning_rate, or a "
            "keras.Variable you store on the model."
        )
    raise ValueError(
        f"No hyper-parameter named {param!r} on {' or '.join(n for n, _ in owners)}. "
        "Name an optimizer attribute (e.g. 'learning_rate'), a model "
        "attribute holding a keras.Variable, or a dotted path from the model "
        "(e.g. 'g_optimizer.learning_rate' for a GAN)."
    )


class HyperParamSetter(Callback):
    """Base class: sets `param` to `_value_to_set()` when triggered.

    Subclasses implement `_value_to_set()`, returning the new value or None
    to leave it. By default it is set at the beginning of every epoch (when
    `self.epoch_num` is already the epoch about to run). Like every variable
    update outside the step, it applies to all towers at once.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> class HalveEveryEpoch(kt.callbacks.HyperParamSetter):
        ...     def _value_to_set(self):
        ...         return 0.1 / 2 ** (self.epoch_num - 1)
        >>> _ = model.fit(x, y, batch_size=4, epochs=3, verbose=0,
        ...               callbacks=[HalveEveryEpoch("learning_rate")])
        >>> round(float(model.optimizer.learning_rate), 6)    # set before epoch 3
        0.025
    """

    def __init__(self, param):
        super().__init__()
        self.param = param
        self._variable = None
        # Every process must set its own copy, not only the chief.
        self.chief_only = False

    @property
    def variable(self):
        if self._variable is None:
            self._variable = _find_variable(self.model, self.param)
        return self._variable

    def get_current_value(self):
        return float(np.asarray(self.variable.numpy()))

    def _value_to_set(self):
        raise NotImplementedError

    def _set(self):
        value = self._value_to_set()
        if value is not None:
            run = self.training_run
            if run is not None:
                # On JAX the towers hold the state between steps: written
                # back first, the variables are what the next step reads.
                run.engine.sync_state()
            self.variable.assign(value)
        return value

    def _before_train(self):
        self.variable  # noqa: B018 - fail early on a bad param name

    def _before_epoch(self):
        self._set()

    def _trigger(self):
        self._set()

    def _trigger_epoch(self):
        # The value for the next epoch is set at its beginning.
        pass


class ScheduledHyperParamSetter(HyperParamSetter):
    """Sets `param` from a schedule of (epoch, value) or (step, value) points.

    Args:
        param: see the module docstring.
        schedule: list of (epoch_num, value), 1-based epochs; value set at the
            beginning of that epoch. With `step_based=True`, (global_step,
            value): in effect from the step that starts when global_step
            (the number of steps done) has reached that number.
        interp: None: the value of the last point reached (piecewise
            constant); "linear": linear between points, the last value
            after the last point. Before the first point the param is left
            as it is.
        step_based: read the schedule in steps instead of epochs.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> schedule = kt.callbacks.ScheduledHyperParamSetter("learning_rate", [(1, 0.1), (3, 0.01)])
        >>> class PrintRate(kt.callbacks.Callback):
        ...     def _before_epoch(self):
        ...         print(self.epoch_num, round(float(self.model.optimizer.learning_rate), 6))
        >>> _ = model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[schedule, PrintRate()])
        1 0.1
        2 0.1
        3 0.01
    """

    def __init__(self, param, schedule, interp=None, step_based=False):
        super().__init__(param)
        unit = "step" if step_based else "epoch"
        points = []
        for point in schedule:
            when, value = point
            points.append((integer(when, f"the {unit} of schedule point {point!r}",
                                   "ScheduledHyperParamSetter", minimum=0), float(value)))
        if not points or points != sorted(points, key=lambda p: p[0]):
            raise ValueError(
                f"ScheduledHyperParamSetter needs a non-empty schedule sorted by "
                f"{'step' if step_based else 'epoch'}; got {schedule!r}."
            )
        if interp not in (None, "linear"):
            raise ValueError(f"interp must be None or 'linear'; got {interp!r}.")
        self.schedule = points
        self.interp = interp
        self.step_based = step_based

    def _value_to_set(self):
        now = self.global_step if self.step_based else self.epoch_num
        if now < self.schedule[0][0]:
            return None
        for (t0, v0), (t1, v1) in zip(self.schedule, self.schedule[1:]):
            if t0 <= now < t1:
                if self.interp == "linear":
                    return v0 + (v1 - v0) * (now - t0) / (t1 - t0)
                return v0
        return self.schedule[-1][1]

    def _trigger_step(self):
        # After a step, global_step is the number of steps done: the value
        # set now is the one the next step reads.
        if self.step_based:
            self._set()


class HyperParamSetterWithFunc(HyperParamSetter):
    """Sets `param` to `func(epoch_num, current_value)` before every epoch.

    `epoch_num` is the 1-based number of the epoch about to begin.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> decay = kt.callbacks.HyperParamSetterWithFunc("learning_rate", lambda epoch, lr: lr * 0.5)
        >>> _ = model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[decay])
        >>> round(float(model.optimizer.learning_rate), 6)    # halved before each of the 3 epochs
        0.0125
    """

    def __init__(self, param, func):
        super().__init__(param)
        if not callable(func):
            raise TypeError(f"HyperParamSetterWithFunc needs a callable; got {func!r}.")
        self.func = func

    def _value_to_set(self):
        return self.func(self.epoch_num, self.get_current_value())


class StatMonitorParamSetter(HyperParamSetter):
    """Changes `param` when a logged stat stops improving.

    Whenever triggered (by default, at the end of every epoch), it reads
    `stat` from the logs (a key of the epoch logs, e.g. "val_loss"); if it
    has not become lower by more than `threshold` than the best value
    before the last `last_k` readings, set `param = value_func(param)` and
    wait `last_k` epochs before the next change. With `reverse=True` the
    stat should become higher instead (e.g. accuracy).

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer=keras.optimizers.SGD(1e-6), loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> # The loss never falls by 1.0 within 2 epochs: the rate halves, then waits 2 epochs.
        >>> halve = kt.callbacks.StatMonitorParamSetter(
        ...     "learning_rate", "loss", lambda lr: lr / 2, threshold=1.0, last_k=2)
        >>> _ = model.fit(x, y, batch_size=4, epochs=6, verbose=0, callbacks=[halve])
        >>> round(float(model.optimizer.learning_rate) / 1e-6, 6)     # halved twice
        0.25
    """

    def __init__(self, param, stat, value_func, threshold, last_k, reverse=False):
        super().__init__(param)
        self.stat = stat
        self.value_func = value_func
        self.threshold = float(threshold)
        self.last_k = integer(last_k, "last_k", "StatMonitorParamSetter", minimum=1)
        self.reverse = reverse
        self.history = []
        self._last_changed_epoch = 0

    def _before_epoch(self):
        pass

    def _trigger(self):
        value = self.read_stat(self.logs, self.stat)
        self.history.append(-value if self.reverse else value)
        self._set()

    def get_resume_state(self):
        """The stat's history and the epoch it last set the parameter in,
        saved with the run's checkpoints (carried_state.py)."""
        return {"history": list(self.history), "last_changed_epoch": self._last_changed_epoch}

    def set_resume_state(self, state):
        self.history = list(state["history"])
        self._last_changed_epoch = state["last_changed_epoch"]

    def _value_to_set(self):
        if len(self.history) <= self.last_k:
            return None
        if self.epoch_num - self._last_changed_epoch < self.last_k:
            return None
        best_before = min(self.history[: -self.last_k])
        recent_best = min(self.history[-self.last_k:])
        if recent_best < best_before - self.threshold:
            return None
        self._last_changed_epoch = self.epoch_num
        return self.value_func(self.get_current_value())

    def _trigger_epoch(self):
        self._trigger()
