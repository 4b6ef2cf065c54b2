"""TowerModel: a keras.Model whose every tower trains on batches of its own.

One class on every backend. `fit`, `evaluate` and `predict` are written
here once; what differs between TensorFlow and JAX (how a step runs on the
towers, how a source is read and placed) is the model's step engine
(`model.engine`, a `kerastower.backend.engine.StepEngine`), and the tower
steps Keras users override (`train_step`, `test_step`, `predict_step`) come
from the backend's part of the class (`backend/<name>/model.py`), as Keras
picks its own trainer per backend.

```python
import keras, numpy as np, kerastower as kt

@kt.distributed("mirrored")
def train(x, y):
    inputs = keras.Input((8,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    return model.fit(x, y, batch_size=16, epochs=2)   # 16 examples per tower
```

Where a tower gets its batch: `model.engine.input_source` makes the
source (kerastower/inputs/); the engine's feed takes one batch per tower
per step and runs the tower step on it.

Who owns each of `fit`'s arguments (read in `TowerModel.fit` below):

- `batch_size`, `epochs`, `verbose`, `initial_epoch`, `steps_per_epoch`,
  `validation_steps`, `validation_batch_size`, `validation_freq`: checked
  as integers by `arguments.fit_integers` (kerastower/arguments.py).
- `x`, `y`, `sample_weight`, `class_weight`, `validation_split`: joined
  into examples by `arguments.fit_data`, then made a source by the engine
  (`input_source`: the kind chosen by `inputs/chooser.py` for both
  backends, placed by `backend/<backend>/inputs.py`), with `batch_size` a tower's batch and `shuffle` its order.
- `validation_data` (and `validation_batch_size`): the engine's
  `validation_source`; `validation_steps` and `validation_freq`: FitSteps
  (kerastower/loop/fit_steps.py), which runs validation at an epoch's end.
- `callbacks`, `verbose`, `logdir`: `training_callbacks`
  (kerastower/loop/main_loop.py) adds the progress bar, History and
  `logdir`'s writers to the user's callbacks.
- `epochs`, `initial_epoch`, `steps_per_epoch`: `MainLoop.run`
  (kerastower/loop/main_loop.py): an epoch is `steps_per_epoch` steps, or
  one pass of the source without it, and only the period of the callbacks.
"""

import keras

from kerastower import _compat
from kerastower import arguments
from kerastower import backend
from kerastower.loop import single_batch
from kerastower.loop.fit_steps import FitSteps
from kerastower.loop.inference_loops import evaluate_loop
from kerastower.loop.inference_loops import predict_loop
from kerastower.loop.main_loop import LoopState
from kerastower.loop.main_loop import MainLoop
from kerastower.loop.main_loop import check_strategy
from kerastower.loop.main_loop import training_callbacks
from kerastower.loop.run import TrainingRun
from kerastower.strategies import switch as strategies

__all__ = ["TowerModel"]


@keras.saving.register_keras_serializable(package="kerastower")
class TowerModel(backend.tower_steps(), keras.Model):
    """A `keras.Model` that trains with tensorpack's tower semantics.

    Use it like `keras.Model`: functionally (`kt.TowerModel(inputs,
    outputs)`), by subclassing, or around an existing Keras model with
    `kt.TowerModel(model)`. Create it under the strategy it will train
    with (inside a `kt.distributed` function or block).

    The steps `train_step`, `test_step` and `predict_step` are tower
    functions: kerastower calls them once per tower per step, inside a
    `TowerContext`, with that tower's batch. `batch_size` is per tower, and
    the update of N towers is that of one device on the joined batch.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0)
        >>> model.loop.global_step
        2
    """

    # What `kt.TowerModel(...)` makes instead of an object of the class
    # called (a functional twin, a wrapper) are subclasses of TowerModel,
    # made by kerastower/functional.py, which hands itself in here when it
    # is imported (the package imports it).
    _variants = None

    def __new__(cls, *args, **kwargs):
        if cls is TowerModel and args and isinstance(args[0], keras.Model):
            return cls._variants.wrapped_by_new(cls, args, kwargs)
        # Keras makes `SomeModel(inputs, outputs)` functional by rewriting the
        # bases of SomeModel and of its parents, TowerModel included, which
        # would turn every later subclass functional too. A functional twin of
        # the class, made once, avoids that.
        if _compat.makes_functional(cls, TowerModel, args, kwargs):
            return super().__new__(cls._variants.functional_twin(cls))
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        if self.__dict__.get("_built_from_model") is not None:
            if self._variants.built_by_new(self, args, kwargs):
                return
        if _compat.functional_init_arguments(args, kwargs) and not isinstance(self, _compat.functional_class()):
            # Keras would make this class, and TowerModel with it, functional
            # for good by rewriting their bases.
            raise TypeError(
                f"{type(self).__name__}.__init__ passed (inputs, outputs) on to "
                "TowerModel, but was called with other arguments. Name the first "
                "two parameters of __init__ `inputs, outputs`, or do not pass two "
                "positional arguments to super().__init__()."
            )
        super().__init__(*args, **kwargs)
        self._tower_strategy = strategies.current_strategy()
        self._fit_loop = LoopState()
        self.training_run = None
        self.engine = backend.make_engine(self)

    @classmethod
    def wrap(cls, model):
        """A TowerModel that shares the layers and weights of `model`, as
        `kt.TowerModel(model)` makes.

        A functional or Sequential model is rebuilt on the same layers;
        any other model is called from a thin TowerModel around it. Build or
        create `model` under the same strategy the TowerModel trains with.
        """
        return cls._variants.wrap(cls, model)

    @property
    def tower_strategy(self):
        """The `kt.TowerStrategy` this model was created under."""
        return self._tower_strategy

    @property
    def num_towers(self):
        return self._tower_strategy.num_towers

    @property
    def loop(self):
        """The `kt.LoopState` of the run that trains this model now, else fit's.

        Under `fit` it is the model's own counters, which go on across
        calls; while a `kt.Trainer` trains the model, the trainer's. The
        training run (`self.training_run`, a `kerastower.loop.run.TrainingRun`)
        owns it; the model only points at the run that trains it.
        """
        run = self.training_run
        return self._fit_loop if run is None else run.state

    def compile(self, *args, jit_compile="auto", check_finite=True, **kwargs):
        """As `keras.Model.compile`; `jit_compile` compiles each tower's work
        with XLA (see kerastower/backend/tensorflow/xla.py): on N towers, the
        forward and backward of `train_step` and the whole `test_step` and
        `predict_step`; on one tower, the whole step. "auto" uses XLA when
        the machine has an accelerator, as Keras does on one device. On JAX
        the whole step is one jitted call; `jit_compile=False` runs one
        tower's step op by op, as Keras-JAX does (N towers always jit:
        docs/performance.md).

        `check_finite=False` drops the NaN/Inf check of every step's reduced
        gradients (docs/reliability.md), which reads them once more: a
        non-finite step is then applied, as stock Keras applies it."""
        kwargs = arguments.compile_kwargs(kwargs)
        super().compile(*args, jit_compile=self.engine.keras_jit_compile(jit_compile), **kwargs)
        if self.optimizer is not None:
            # Gradient accumulation weighs a token-normalised loss's
            # micro-steps by their tokens (docs/training.md).
            _compat.keep_loss_counts(self.optimizer)
        # Saved as given: Keras's own is off, the towers' steps compile themselves.
        self._tower_jit_compile_given = jit_compile
        self.tower_check_finite = arguments.boolean(check_finite, "check_finite", "compile")
        self.engine.compiled(jit_compile)

    def get_compile_config(self):
        """Keras's compile config, with `check_finite` when it was turned off
        and `jit_compile` as `compile` was given it (a loaded model compiles
        its steps as the saved one did)."""
        config = super().get_compile_config()
        if config is not None and "jit_compile" in config:
            config = dict(config, jit_compile=getattr(self, "_tower_jit_compile_given", "auto"))
        if config is not None and not getattr(self, "tower_check_finite", True):
            config = dict(config, check_finite=False)
        return config

    def compile_from_config(self, config):
        """Compiles a loaded model as Keras would; needed because `compile`
        is overridden (it takes `check_finite`)."""
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    # ------------------------------------------------------------------
    # fit / evaluate / predict

    def fit(
        self,
        x=None,
        y=None,
        batch_size=None,
        epochs=1,
        verbose="auto",
        callbacks=None,
        validation_split=0.0,
        validation_data=None,
        shuffle=True,
        class_weight=None,
        sample_weight=None,
        initial_epoch=0,
        steps_per_epoch=None,
        validation_steps=None,
        validation_batch_size=None,
        validation_freq=1,
        logdir=None,
    ):
        """Trains the model; `batch_size` and the batches of a dataset are per tower.

        Takes the arguments of `keras.Model.fit`. With `steps_per_epoch` set,
        one iterator runs through all epochs (an epoch is only the period at
        which callbacks run), and a source that runs out raises an error.
        `logdir` adds TensorBoard, JSONWriter (stats.json) and
        ThroughputTracker there, unless `callbacks` has them already.
        """
        _compat.assert_compile_called(self, "fit")
        check_strategy(self, "fit")
        (batch_size, epochs, verbose, initial_epoch, steps_per_epoch, validation_steps,
         validation_batch_size, validation_freq) = arguments.fit_integers(
            batch_size, epochs, verbose, initial_epoch, steps_per_epoch, validation_steps,
            validation_batch_size, validation_freq)
        self.engine.check_validation_split(x, validation_split)
        x, y, sample_weight, validation_data = arguments.fit_data(
            x, y, sample_weight, class_weight, validation_split, validation_data)
        source = self.engine.input_source(
            x, y, sample_weight, batch_size, shuffle=shuffle, repeat=bool(steps_per_epoch),
            method="fit", steps=steps_per_epoch)
        validation = None
        if validation_data is not None:
            validation = {
                "source": self.engine.validation_source(
                    validation_data, validation_batch_size or batch_size, validation_steps),
                "steps": validation_steps,
                "freq": validation_freq,
            }
        self.engine.build_for(source, step="train")
        epoch_length = steps_per_epoch or source.steps(self.num_towers)
        run = TrainingRun(self, self._fit_loop, "fit")
        with run.training():
            run.callbacks = callbacks = training_callbacks(
                self, run.state, callbacks, verbose, logdir, epochs, epoch_length)
            if run.state.global_step == 0 and self.optimizer is not None:
                # A model trained or loaded by Keras before goes on counting.
                run.state.global_step = int(keras.ops.convert_to_numpy(self.optimizer.iterations))
            steps = FitSteps(self, source, callbacks, steps_per_epoch, validation, verbose)
            with self.engine.running(source):
                MainLoop(run).run(steps, initial_epoch + 1, epochs, steps_per_epoch,
                                  epoch_length=epoch_length)
        return self.history

    def evaluate(
        self,
        x=None,
        y=None,
        batch_size=None,
        verbose="auto",
        sample_weight=None,
        steps=None,
        callbacks=None,
        return_dict=False,
        **kwargs,
    ):
        """Evaluates data-parallel and exactly: each example counted once."""
        from_fit = kwargs.pop("_from_fit", False)
        if kwargs:
            raise ValueError(f"Arguments not recognized: {kwargs}")
        _compat.assert_compile_called(self, "evaluate")
        check_strategy(self, "evaluate")
        batch_size, steps, verbose = arguments.inference_integers("evaluate", batch_size, steps, verbose)
        source = self.engine.input_source(x, y, sample_weight, batch_size, method="evaluate", steps=steps)
        if not from_fit:
            self.engine.build_for(source, step="test")
        callbacks = arguments.inference_callbacks(self, callbacks, verbose, steps, source)
        with self.engine.running(source):
            logs = evaluate_loop(self, source, steps, callbacks)
        if return_dict:
            return logs
        return _compat.flatten_metrics_in_order(self, logs)

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """Predicts data-parallel; outputs come back in input order.

        With a shared source, tower k of a step takes the k-th next batch, so
        concatenating the towers' outputs step by step restores the order.
        """
        check_strategy(self, "predict")
        batch_size, steps, verbose = arguments.inference_integers("predict", batch_size, steps, verbose)
        source = self.engine.input_source(x, None, None, batch_size, method="predict", steps=steps)
        self.engine.build_for(source, step=None, with_targets=False)
        callbacks = arguments.inference_callbacks(self, callbacks, verbose, steps, source)
        with self.engine.running(source):
            return predict_loop(self, source, steps, callbacks)

    # ------------------------------------------------------------------
    # One step on a given batch: on N towers, tower k takes its k-th part.

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        """As `keras.Model.train_on_batch`; on N towers the batch is the
        joined batch, tower k taking its k-th equal part (loop/single_batch.py)."""
        return single_batch.train_on_batch(self, x, y, sample_weight, class_weight, return_dict)

    def test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
        """As `keras.Model.test_on_batch`; on N towers, as `train_on_batch`."""
        return single_batch.test_on_batch(self, x, y, sample_weight, return_dict)

    def predict_on_batch(self, x):
        """As `keras.Model.predict_on_batch`; on N towers, as `train_on_batch`."""
        return single_batch.predict_on_batch(self, x)
