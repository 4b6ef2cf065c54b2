"""TowerModel: a keras.Model whose every tower trains on batches of its own.

`fit`, `evaluate` and `predict` take an InputSource, a `tf.data.Dataset` or
numpy arrays. Under a strategy with N towers, each step runs the model's step
once per tower, under a `TowerContext`, on a whole batch that tower took from
the input; nothing is split, so `total batch = per-tower batch x N`.

```python
import keras, numpy as np, kerastower as kt

@kt.distributed("mirrored")
def train(x, y):
    inputs = keras.Input((8,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    return model.fit(x, y, batch_size=16, epochs=2)   # 16 examples per tower
```

Where a tower gets its batch: `InputSource.distribute` (inputs.py) makes the
per-tower iterator; `_make_step_function` below pulls one batch per tower per
step and runs the tower step (`train_step`, `test_step`, `predict_step`) on it.
"""

import keras
import tensorflow as tf

from kerastower import _compat
from kerastower.model_common import TowerModelCommon
from kerastower import arguments
from kerastower import batch_checks
from kerastower import strategies
from kerastower import inference_loops
from kerastower.engine import gradients as tower_gradients
from kerastower.engine import tf_step
from kerastower.engine import xla
from kerastower.errors import TowerRuleError
from kerastower.inputs import as_input_source
from kerastower.fit_steps import FitSteps
from kerastower.loop import LoopState
from kerastower.loop import MainLoop
from kerastower.loop import check_strategy
from kerastower.loop import training_callbacks

__all__ = ["TowerModel"]


class _StepCache:
    """What the step functions remember between traces."""

    def __init__(self):
        self.local_weights = None
        self.last_gradients = None
        self.collectives = {}
        self.read_logs = None


@keras.saving.register_keras_serializable(package="kerastower")
class TowerModel(TowerModelCommon, keras.Model):
    """A `keras.Model` that trains with tensorpack's tower semantics.

    Use it like `keras.Model`: functionally (`kt.TowerModel(inputs,
    outputs)`), by subclassing, or around an existing Keras model with
    `kt.TowerModel(model)`. Create it under the strategy it will train
    with (inside a `kt.distributed` function or block).

    The steps `train_step`, `test_step` and `predict_step` are tower
    functions: kerastower calls them once per tower per step, inside a
    `TowerContext`, with that tower's batch.

    Examples:
        >>> import keras, numpy as np, kerastower as kt
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0)
    """

    def __new__(cls, *args, **kwargs):
        if cls is TowerModel and args and isinstance(args[0], keras.Model):
            from kerastower import functional

            return functional.wrapped_by_new(cls, args, kwargs)
        # Keras makes `SomeModel(inputs, outputs)` functional by rewriting the
        # bases of SomeModel and of its parents, TowerModel included, which
        # would turn every later subclass functional too. A functional twin of
        # the class, made once, avoids that.
        if _compat.makes_functional(cls, TowerModel, args, kwargs):
            from kerastower import functional

            return super().__new__(functional.functional_twin(cls))
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        if self.__dict__.get("_built_from_model") is not None:
            from kerastower import functional

            if functional.built_by_new(self, args, kwargs):
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
        # Lists of variables set as model attributes would be tracked by Keras
        # as the model's own variables (reordering model.variables); a plain
        # holder keeps these caches out of its sight.
        self._step_cache = _StepCache()
        self.loop = LoopState()

    @classmethod
    def wrap(cls, model):
        """A TowerModel that shares the layers and weights of `model`, as
        `kt.TowerModel(model)` makes.

        A functional or Sequential model is rebuilt on the same layers;
        any other model is called from a thin TowerModel around it. Build or
        create `model` under the same strategy the TowerModel trains with.
        """
        from kerastower import functional

        return functional.wrap(cls, model)

    @property
    def tower_strategy(self):
        """The `kt.TowerStrategy` this model was created under."""
        return self._tower_strategy

    @property
    def num_towers(self):
        return self._tower_strategy.num_towers

    def compile(self, *args, jit_compile="auto", check_finite=True, **kwargs):
        """As `keras.Model.compile`; `jit_compile` compiles each tower's work
        with XLA (kerastower/engine/xla.py): on N towers `train_step`'s forward
        and backward and the whole `test_step` and `predict_step`, on one the
        whole step; "auto" uses XLA when there is an accelerator.
        `check_finite=False` drops each step's NaN check (docs/reliability.md)."""
        kwargs = arguments.compile_kwargs(kwargs)
        # Keras's step functions (they would jit the cross-tower work) are unused.
        super().compile(*args, jit_compile=False, **kwargs)
        self.tower_jit_compile = xla.resolve(self, jit_compile)
        self.tower_check_finite = arguments.boolean(check_finite, "check_finite", "compile")
        self._step_cache.read_logs = None  # it read the metrics compile replaced

    # ------------------------------------------------------------------
    # Tower functions: called once per tower, under a TowerContext.

    def tower_loss(self, x, y, y_pred, sample_weight=None, training=True):
        """This tower's loss: the compiled loss (plus `model.losses`), or
        what an overridden `compute_loss` returns; a scalar, the tower's own
        mean (Keras does not divide it by the number of towers in a tower)."""
        loss = _compat.compute_loss(
            self, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
        )
        if loss.shape.rank != 0:
            raise TowerRuleError(
                f"The loss must be a scalar; got a tensor of shape {loss.shape}. "
                "Tower rule: compute_loss returns one number per tower (reduce "
                "with a mean or sum over the batch). See docs/towers.md, rule 4."
            )
        return loss

    def run_on_towers(self, fn, data, is_training=False):
        """Calls `fn(tower_data)` once per tower under its TowerContext.

        `data` is one step's per-tower batches (what the distributed iterator
        of an InputSource gives); returns the per-tower results, whose values
        `self.tower_strategy.tower_values(result)` lists in tower order.
        """
        def in_tower(tower_data):
            with self.tower_scope(is_training, getattr(fn, "__qualname__", "run_on_towers")):
                return fn(tower_data)

        return self._tower_strategy.run(in_tower, args=(data,))

    def tower_scope(self, is_training, step_name, name=None, examples=None):
        """Inside a tower: enters its TowerContext and the tower rules.

        Only the main tower records `tf.summary` data, and creating a variable
        raises a TowerRuleError naming `step_name`. In training, the towers'
        replica-local weights (BatchNormalization's statistics) follow the
        main tower's when the block ends. `examples`, this tower's batch
        size, sets the share `optimizer.apply` weights its gradients by
        (default: 1/N). Yields the TowerContext.
        """
        return tf_step.tower_scope(self, is_training, step_name, name=name, examples=examples)

    def _call_tower(self, x, training):
        if _compat.call_has_training_arg(self):
            return self(x, training=training)
        return self(x)

    def train_step(self, data):
        """One tower's training step on its own batch `data`.

        Computes the gradient of this tower's mean loss, as one device would,
        and calls `optimizer.apply`, which inside a tower applies the
        example-weighted mean over towers (reduced before clipping). Returns
        this tower's metric results; `fit` logs the metrics read across towers.
        """
        x, y, sample_weight = _compat.unpack_x_y_sample_weight(data)
        num_examples = tf_step.num_examples(data)
        variables = self.trainable_weights

        @xla.compiled_in(self)
        def forward_backward():
            with batch_checks.checked_step(self, "train", x, y) as check:
                with tf.GradientTape() as tape:
                    y_pred = check.outputs(self._call_tower(x, training=True))
                    loss = self.tower_loss(x, y, y_pred, sample_weight, training=True)
                    # An empty batch has a NaN mean loss; it must count as zero.
                    loss = tf.where(num_examples > 0, loss, tf.zeros_like(loss))
                    scaled_loss = self.optimizer.scale_loss(loss)
                _compat.loss_tracker(self).update_state(loss, sample_weight=num_examples)
                self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            return tape.gradient(scaled_loss, variables)

        gradients = tower_gradients.gradients_unless_empty(self, forward_backward, num_examples, variables)
        self.optimizer.apply(gradients, variables)
        return self.get_metrics_result()

    def test_step(self, data):
        """One tower's evaluation step on its own batch `data`."""
        x, y, sample_weight = _compat.unpack_x_y_sample_weight(data)
        num_examples = tf_step.num_examples(data)
        with batch_checks.checked_step(self, "test", x, y) as check:
            y_pred = check.outputs(self._call_tower(x, training=False))
            loss = self.tower_loss(x, y, y_pred, sample_weight, training=False)
            loss = tf.where(num_examples > 0, loss, tf.zeros_like(loss))
            _compat.loss_tracker(self).update_state(loss, sample_weight=num_examples)
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def predict_step(self, data):
        """One tower's predictions for its own batch `data`."""
        x, _, _ = _compat.unpack_x_y_sample_weight(data)
        return self._call_tower(x, training=False)

    # ------------------------------------------------------------------
    # Step functions: one batch per tower per step (kerastower/engine).

    def make_train_function(self, force=False):
        if self.train_function is None or force:
            xla.warn_if_not_compiled(self, type(self).train_step is not TowerModel.train_step)
            self.train_function = tf_step.make_step_function(self, self.train_step, "train")
        return self.train_function

    def make_test_function(self, force=False):
        if self.test_function is None or force:
            self.test_function = tf_step.make_step_function(self, self.test_step, "test")
        return self.test_function

    def make_predict_function(self, force=False):
        if self.predict_function is None or force:
            self.predict_function = tf_step.make_step_function(self, self.predict_step, "predict")
        return self.predict_function

    # ------------------------------------------------------------------
    # fit / evaluate / predict

    def _build_for(self, source, with_targets=True, step=None):
        """Creates every variable (layers, metrics, optimizer slots) from the
        spec of tower 0's batches, so that no tower step creates one; a batch
        that does not fit the model raises a DataMismatchError naming `step`
        ("train", "test", "predict"). See `batch_checks.build_for`."""
        batch_checks.build_for(self, source, with_targets, step)

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
        x, y, sample_weight, validation_data = arguments.fit_data(
            x, y, sample_weight, class_weight, validation_split, validation_data)
        source = as_input_source(
            x, y, sample_weight, batch_size, shuffle, repeat=bool(steps_per_epoch)
        )
        validation = None
        if validation_data is not None:
            validation = {
                "source": arguments.validation_source(
                    validation_data, validation_batch_size or batch_size),
                "steps": validation_steps,
                "freq": validation_freq,
            }
        self._build_for(source, step="train")
        epoch_length = steps_per_epoch or source.steps(self.num_towers)
        callbacks = training_callbacks(self, callbacks, verbose, logdir, epochs, epoch_length)
        if self.loop.global_step == 0 and self.optimizer is not None:
            # A model trained or loaded by Keras before goes on counting.
            self.loop.global_step = int(self.optimizer.iterations.numpy())
        steps = FitSteps(self, source, callbacks, steps_per_epoch, validation, verbose)
        with batch_checks.original_errors():
            MainLoop(self, self.loop, callbacks, "fit").run(
                steps, initial_epoch + 1, epochs, steps_per_epoch, epoch_length=epoch_length
            )
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
        source = as_input_source(x, y, sample_weight, batch_size)
        if not from_fit:
            self._build_for(source, step="test")
        callbacks = arguments.inference_callbacks(self, callbacks, verbose, steps, source)
        with batch_checks.original_errors():
            logs = inference_loops.evaluate_loop(self, source, steps, callbacks)
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
        source = as_input_source(x, batch_size=batch_size)
        self._build_for(source, with_targets=False)
        callbacks = arguments.inference_callbacks(self, callbacks, verbose, steps, source)
        return inference_loops.predict_loop(self, source, steps, callbacks)
