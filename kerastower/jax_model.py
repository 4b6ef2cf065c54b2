"""TowerModel on the JAX backend: the same tower semantics, JAX's step engine.

With `KERAS_BACKEND=jax`, `kt.TowerModel` is this class. `fit` runs the
one training loop (loop.py) with every callback; each iteration is one call
of the jitted tower step (engine/jax_step.py) on one batch per tower.
Towers keep Keras's JAX steps: `train_step(self, state, data)`,
`compute_loss` overrides and custom steps run as they are, once per tower.

```python
import os; os.environ["KERAS_BACKEND"] = "jax"
import keras, numpy as np, kerastower as kt

with kt.distributed("mirrored"):          # every local JAX device
    inputs = keras.Input((8,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((64, 8)), np.ones((64, 1)), batch_size=8)   # 8 per tower
```
"""

import contextlib
import itertools

import keras
import numpy as np

from kerastower import _compat
from kerastower import arguments
from kerastower import jax_sources
from kerastower import strategies
from kerastower.engine import jax_step
from kerastower.errors import InputSourceError
from kerastower.fit_steps import FitSteps
from kerastower.loop import LoopState
from kerastower.loop import MainLoop
from kerastower.loop import check_strategy
from kerastower.loop import training_callbacks
from kerastower.model_common import TowerModelCommon

__all__ = ["TowerModel"]

_FUNCTIONAL_TWINS = {}


@keras.saving.register_keras_serializable(package="kerastower")
class TowerModel(TowerModelCommon, keras.Model):
    """A `keras.Model` that trains with tensorpack's tower semantics, on JAX.

    Under a strategy with N towers (`kt.distributed("mirrored")`), each
    step runs the model's `train_step` once per tower, under a
    `TowerContext`, on a whole batch that tower took; `batch_size` is per
    tower. The update is that of one device on the joined batch.

    Examples:
        >>> import keras, numpy as np, kerastower as kt
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0)
        >>> model.loop.global_step
        2
    """

    def __new__(cls, *args, **kwargs):
        # Keras makes `SomeModel(inputs, outputs)` functional by rewriting the
        # bases of SomeModel and its parents, TowerModel included, which would
        # make every later subclass functional; a functional twin avoids that.
        functional = _compat.functional_class()
        if _compat.makes_functional(cls, TowerModel, args, kwargs):
            if cls not in _FUNCTIONAL_TWINS:
                _FUNCTIONAL_TWINS[cls] = type(cls.__name__, (cls, functional), {"__module__": cls.__module__})
            return super().__new__(_FUNCTIONAL_TWINS[cls])
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._tower_strategy = strategies.current_strategy()
        self.loop = LoopState()
        self._engines = {}

    @property
    def tower_strategy(self):
        """The strategy this model was created under."""
        return self._tower_strategy

    @property
    def num_towers(self):
        return self._tower_strategy.num_towers

    def compile(self, *args, check_finite=True, **kwargs):
        """As `keras.Model.compile`; `check_finite=False` drops each step's
        NaN check of the reduced gradients (docs/reliability.md)."""
        kwargs = arguments.compile_kwargs(kwargs)
        super().compile(*args, **kwargs)
        self.tower_check_finite = arguments.boolean(check_finite, "check_finite", "compile")
        self._engines = {}

    def engine(self, num_towers=None):
        """The `jax_step.TowerSteps` of the first `num_towers` towers (all by default)."""
        devices = self._tower_strategy.step_devices(num_towers or self.num_towers)
        if len(devices) not in self._engines:
            mesh = jax_step.tower_mesh(devices)
            self._engines[len(devices)] = jax_step.TowerSteps(
                self, mesh, getattr(self, "tower_check_finite", True))
        return self._engines[len(devices)]

    def run_towers(self, mode, batches, placed=None):
        """One test or predict step on `batches` (one per tower, or one
        holding a pass's last examples); for "train", the steps `batches`
        (a list of such lists) in one call (`placed`: them on the devices)."""
        engine = self.engine(len(batches[0]) if mode == "train" else len(batches))
        for other in self._engines.values():
            if other is not engine:
                other.sync()
                other.reset_metrics()  # the model's metrics hold the last step's
        if mode == "train":
            return engine.train_steps(batches, placed)
        return getattr(engine, mode)(batches)

    def jax_state_sync(self):
        """Writes the weights the towers hold into the model's variables
        (Keras calls it when a callback reads `self.model`)."""
        super().jax_state_sync()
        for engine in getattr(self, "_engines", {}).values():
            engine.sync()

    def reset_metrics(self):
        super().reset_metrics()
        for engine in self._engines.values():
            engine.reset_metrics()

    @contextlib.contextmanager
    def training_metrics_kept(self):
        """Puts the training metrics back as they were after the block
        (an evaluation in the middle of training resets them)."""
        variables = [np.asarray(v.value) for v in self.metrics_variables]
        engines = {n: engine.metric_values() for n, engine in self._engines.items()}
        try:
            yield
        finally:
            for variable, value in zip(self.metrics_variables, variables):
                variable.assign(value)
            for n, values in engines.items():
                self._engines[n].restore_metric_values(values)

    def make_train_function(self, force=False):
        return self.engine()

    def _batches(self, x, y, sample_weight, batch_size, shuffle=False):
        """numpy arrays, a generator or a PyDataset as per-tower batches (jax_sources.py)."""
        source = jax_sources.tower_batches(x, y, sample_weight, batch_size, shuffle)
        if getattr(source, "shuffle_seed", None) is not None:
            source.shuffle_seed = self._tower_strategy.agree_on_seed(source.shuffle_seed)
        return source

    def _build_from(self, batches):
        """Builds the model, its loss and metrics from the source's first
        batch, read only when something is still unbuilt."""
        unbuilt = (not all(layer.built for layer in _compat.flatten_layers(self))
                   or any(not getattr(getattr(self, name, None), "built", True)
                          for name in ("_compile_metrics", "_compile_loss")))
        _compat.symbolic_build(self, batches.first_batch() if unbuilt else None)

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
            validation_batch_size=None, validation_freq=1, logdir=None):
        """Trains the model; `batch_size` is per tower (see `keras.Model.fit`)."""
        _compat.assert_compile_called(self, "fit")
        check_strategy(self, "fit")
        (batch_size, epochs, verbose, initial_epoch, steps_per_epoch, validation_steps,
         validation_batch_size, validation_freq) = arguments.fit_integers(
            batch_size, epochs, verbose, initial_epoch, steps_per_epoch, validation_steps,
            validation_batch_size, validation_freq)
        if validation_split and jax_sources.is_batched(x):
            raise InputSourceError(
                f"validation_split cuts numpy arrays; x is a {type(x).__name__}. Pass "
                "validation_data (arrays, a generator or a PyDataset) instead.")
        x, y, sample_weight, validation_data = arguments.fit_data(
            x, y, sample_weight, class_weight, validation_split, validation_data)
        batches = self._batches(x, y, sample_weight, batch_size, shuffle)
        if not steps_per_epoch:
            batches.check_finite("fit")
        validation = None
        if validation_data is not None:
            val_x, val_y, val_weight = _unpacked(validation_data)
            if not jax_sources.is_batched(val_x):
                validation_batch_size = validation_batch_size or batch_size
            validation = {"source": self._batches(val_x, val_y, val_weight, validation_batch_size),
                          "steps": validation_steps, "freq": validation_freq}
            if not validation_steps:
                validation["source"].check_finite("fit", "validation_steps")
        self._build_from(batches)
        epoch_length = steps_per_epoch or batches.steps(self.num_towers)
        callbacks = training_callbacks(self, callbacks, verbose, logdir, epochs, epoch_length)
        if self.loop.global_step == 0 and self.optimizer is not None:
            self.loop.global_step = int(self.optimizer.iterations.numpy())
        steps = JaxFitSteps(self, batches, callbacks, steps_per_epoch, validation, verbose)
        try:
            MainLoop(self, self.loop, callbacks, "fit").run(
                steps, initial_epoch + 1, epochs, steps_per_epoch, epoch_length=epoch_length)
        finally:
            self.jax_state_sync()  # also when training stopped on an error
        return self.history

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
                 steps=None, callbacks=None, return_dict=False, **kwargs):
        """Evaluates data-parallel and exactly: each example counted once."""
        kwargs.pop("_from_fit", None)
        if kwargs:
            raise ValueError(f"Arguments not recognized: {kwargs}")
        _compat.assert_compile_called(self, "evaluate")
        check_strategy(self, "evaluate")
        batches = self._batches(x, y, sample_weight, batch_size)
        if not steps:
            batches.check_finite("evaluate")
        self._build_from(batches)
        self.reset_metrics()
        logs = {}
        # islice takes no batch past the last step: a generator keeps the rest.
        for tower_batches in itertools.islice(batches.one_pass(self.num_towers), steps or None):
            logs = self.run_towers("test", tower_batches)
        if not logs:
            raise InputSourceError(
                "evaluate() got no batch: the input is empty (or a generator already used up).")
        logs = _compat.pythonify_logs(logs)
        return logs if return_dict else _compat.flatten_metrics_in_order(self, logs)

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """Predicts data-parallel; outputs come back in input order."""
        check_strategy(self, "predict")
        batches = self._batches(x, None, None, batch_size)
        if not steps:
            batches.check_finite("predict")
        outputs = []
        for tower_batches in itertools.islice(batches.one_pass(self.num_towers), steps or None):
            outputs.append(self.run_towers("predict", tower_batches))
        if not outputs:
            raise InputSourceError(
                "predict() got no batch: the input is empty (or a generator already used up).")
        return keras.tree.map_structure(
            lambda *parts: np.concatenate([np.asarray(p) for p in parts], axis=0), *outputs)


@keras.saving.register_keras_serializable(package="kerastower")
class FunctionalTowerModel(TowerModel, _compat.functional_class()):
    """What `kt.TowerModel(inputs, outputs)` makes on JAX: a functional
    TowerModel, registered so that a saved one loads (as on TensorFlow,
    where it has the same name)."""


_FUNCTIONAL_TWINS[TowerModel] = FunctionalTowerModel


def _shapes(step):
    return [[np.shape(leaf) for leaf in keras.tree.flatten(batch)] for batch in step]


def _unpacked(data):
    data = tuple(data) if isinstance(data, (tuple, list)) else (data,)
    return data + (None,) * (3 - len(data))


class JaxFitSteps(FitSteps):
    """fit's iteration on JAX: one jitted tower step per batch of every tower."""

    def start(self, skip_batches, epoch_num):
        """Opens the input, on a resume where the run was.

        `skip_batches` (each tower's batches taken; on JAX every tower
        counts the steps) are those of pass `epoch_num - 1` when an epoch is
        one pass, else of the whole run. Arrays and PyDatasets replay their
        pass's order from the seed and skip what was taken; a generator's
        batches are read and dropped."""
        self.endless = bool(self.steps_per_epoch)
        self._ahead = self._pending = None
        skip = max(skip_batches) if skip_batches else 0
        self.resumed_pass = None
        if self.endless:
            self.iterator = self.source.endless(self.model.num_towers, skip_steps=skip)
        elif skip:
            self.resumed_pass = list(skip_batches)

    def before_epoch(self, loop):
        self.model.reset_metrics()
        self.loop = loop
        if not self.endless:
            loop.tower_batches = [0] * self.model.num_towers
            self._ahead = self._pending = None  # a new pass, a new iterator
            skip = 0
            if self.resumed_pass is not None:
                loop.tower_batches, self.resumed_pass = self.resumed_pass, None
                skip = max(loop.tower_batches)
            self.iterator = self.source.one_pass(
                self.model.num_towers, loop.epoch_num - 1, skip_steps=skip)

    def run(self, num_steps):
        """Up to `num_steps` steps (`steps_per_execution`), in as few jitted
        calls as the input allows: one, unless a step of another shape (a
        pass's short last step) must run on its own."""
        self.run_hooks.before_run()
        ran = 0
        while ran < num_steps:
            steps, placed = self._ahead or (self._take_steps(num_steps - ran), None)
            self._ahead = None
            if not steps:
                break
            self.logs, finite = self.model.run_towers("train", steps, placed)
            self._ahead = self._read_ahead(self._next_call_steps(num_steps, ran + len(steps)))
            failed = jax_step.first_nonfinite_step(finite)  # waits for the steps
            done = len(steps) if failed is None else failed[0]
            for batches in steps[:done]:
                examples = [len(keras.tree.flatten(b)[0]) for b in batches]
                self.loop.tower_batches = [n + 1 for n in self.loop.tower_batches]
                self.loop.examples_seen += sum(examples)
                self._announce_total_batch(examples * (self.model.num_towers // len(examples)))
            ran += done
            if failed is not None:
                self.failure = (self.loop.global_step + ran + 1, failed[1])
                break
        self.run_hooks.after_run(self.logs)
        return ran, self.logs

    _pending = None  # a step taken from the input that must run in a call of its own

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
        return steps, self.model.engine(len(steps[0])).place_steps(steps)

    def epoch_logs(self, loop):
        self.model.jax_state_sync()  # epoch-end callbacks and validation read the weights
        return super().epoch_logs(loop)

    def _logs_of_every_tower(self):
        return dict(self.logs)  # the step's logs are every process's towers' already

    def ended_early(self, loop, step):
        if self.failure is None and self.steps_per_epoch:
            raise InputSourceError(
                f"The input ran out after {step} of steps_per_epoch={self.steps_per_epoch} "
                f"steps in epoch {loop.epoch_num}. With steps_per_epoch set, an epoch is only "
                "the period at which callbacks run, and every step takes one batch per tower "
                f"({self.model.num_towers}): the generator must go on (e.g. loop forever), or "
                "leave steps_per_epoch unset to make an epoch one pass.")
        super().ended_early(loop, step)
