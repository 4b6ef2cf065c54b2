"""`kt.Trainer`: tensorpack's training loop, for training that is not `fit`.

Training is running some iterations:

    for epoch_num in range(starting_epoch, max_epoch + 1):
        for local_step in range(steps_per_epoch):
            run_step()

The trainer runs the loop and the callbacks around it; a subclass says what
an iteration is by overriding `run_step()`. An epoch is only the period at
which callbacks run.

```python
import keras, numpy as np, tensorflow as tf, kerastower as kt

class Counter(kt.TowerModel):
    def __init__(self):
        super().__init__()
        self.total = self.add_weight(shape=(), initializer="zeros", trainable=False)

class SumTrainer(kt.Trainer):
    def run_step(self):
        batch_sum = self.hooked_run(self.summed, self.next_batches())
        self.model.total.assign_add(batch_sum["sum"])
        return batch_sum

    @kt.Trainer.tower_function(reduce="sum")
    def summed(self, batch):              # once per tower, on its own batch
        return {"sum": tf.reduce_sum(batch)}

model = Counter()
data = tf.data.Dataset.from_tensors(tf.ones([4])).repeat()
SumTrainer(model, data).train(steps_per_epoch=5, max_epoch=2, verbose=0)
assert float(model.total.numpy()) == 40.0
```
"""

import functools
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras.src.utils import io_utils
from keras.src.utils.python_utils import pythonify_logs

from kerastower.callbacks.base import RunHooks
from kerastower.errors import InputSourceError
from kerastower.errors import KerasTowerError
from kerastower.inputs import InputSource
from kerastower.inputs import as_input_source
from kerastower.loop import LoopState
from kerastower.model import TowerModel
from kerastower.engine.tf_step import num_examples
from kerastower.strategies import training_optimizers

__all__ = ["Trainer", "StopTraining"]


class StopTraining(Exception):
    """Raise it from `run_step()` or from a callback to end training now.

    The loop stops at once (the current epoch does not finish), every
    callback's `_after_train` runs, and `train()` returns normally.
    """


class Trainer:
    """Runs `run_step()` in epochs of `steps_per_epoch` iterations, with callbacks.

    Args:
        model: the `kt.TowerModel` being trained: what callbacks see as
            `self.model`, what checkpoints save (its variables and those of
            every optimizer it holds). Create it under the strategy to train
            with; the trainer runs on the model's strategy.
        input: optional `kt.InputSource` or `tf.data.Dataset` (batched per
            tower, and endless: an epoch does not end the data).
            `next_batches()` takes one batch per tower from it.
        train_op: optional callable; the default `run_step()` calls it
            through the hooked path. Subclasses override `run_step()` instead.

    Attributes:
        loop: the `kt.LoopState`, whose `global_step` counts iterations.
    """

    def __init__(self, model, input=None, train_op=None):
        if not isinstance(model, TowerModel):
            raise TypeError(
                f"{type(self).__name__} trains a kt.TowerModel; got "
                f"{type(model).__name__}. Subclass kt.TowerModel (or use "
                "kt.TowerModel.wrap(model)) so callbacks and checkpoints can find "
                "its variables and loop state."
            )
        if input is not None and not isinstance(input, (InputSource, tf.data.Dataset)):
            raise InputSourceError(
                f"{type(self).__name__}: input must be a kt.InputSource or a "
                f"tf.data.Dataset; got {type(input).__name__}. Wrap arrays in "
                "tf.data.Dataset.from_tensor_slices(...).batch(n).repeat()."
            )
        self.model = model
        self.strategy = model.tower_strategy
        self.input = None if input is None else as_input_source(input)
        self.train_op = train_op
        self.loop = LoopState(model, counts_iterations=True)
        self._run_hooks = RunHooks([])
        self._iterator = None
        self._is_set_up = False
        self._step_logs = {}

    # ------------------------------------------------------------------
    # Loop counters, as in tensorpack.

    @property
    def global_step(self):
        return self.loop.global_step

    @property
    def epoch_num(self):
        return self.loop.epoch_num

    @property
    def local_step(self):
        return self.loop.local_step

    @property
    def num_towers(self):
        return self.strategy.num_towers

    # ------------------------------------------------------------------
    # What an iteration is.

    def run_step(self):
        """One iteration. Override it; the default calls `train_op` hooked.

        Returns the step's logs (a dict of scalars) or None; with None, the
        logs are the dict outputs of the step's hooked runs, merged.
        """
        if self.train_op is None:
            raise NotImplementedError(
                f"{type(self).__name__} has no run_step(): subclass kt.Trainer "
                "and override run_step(), or pass train_op=callable."
            )
        return self.hooked_run(self.train_op)

    def hooked_run(self, fn, *args, **kwargs):
        """Calls `fn(*args, **kwargs)` through the hooked path.

        Callbacks' `_before_run()` run before it and `_after_run(outputs)`
        after it; a dict it returns joins the step's logs. Call `fn` directly
        (a plain call) for work callbacks should not see: sampling images to
        look at, a side computation, an inner loop.
        """
        outputs = self._run_hooks(fn, *args, **kwargs)
        if isinstance(outputs, dict):
            self._step_logs.update(outputs)
        return outputs

    def _setup(self):
        """Called once, before the first `train()` begins: create here every
        variable the steps need (optimizer slots) that the model has not."""

    # ------------------------------------------------------------------
    # Towers: make run_step data-parallel.

    def next_batches(self):
        """This step's batches, one per tower, taken from `input`.

        Pass them to a `tower_function`; each tower gets its own.
        """
        if self.input is None:
            raise InputSourceError(
                f"{type(self).__name__}.next_batches(): the trainer has no input; "
                "pass input=... to its constructor."
            )
        if self._iterator is None:
            raise KerasTowerError("next_batches() is called from run_step(), during train().")
        has_data, batches = self.strategy.next_step(self._iterator)
        if not bool(has_data):
            raise InputSourceError(
                f"The input ran out at global step {self.global_step} (epoch "
                f"{self.epoch_num}, step {self.local_step}). An epoch is only the "
                "period at which callbacks run and the input must not end: call "
                ".repeat() on the dataset."
            )
        self.loop.tower_batches = [n + 1 for n in self.loop.tower_batches]
        batches = batches()
        self.loop.examples_seen += self._examples_in(batches)
        return batches

    def _examples_in(self, batches):
        """Examples in one step's batches, all towers counted. A process sees
        its own towers' batches; with one tower per process (Horovod,
        multi-worker), the others are counted as the same size: an endless
        input gives every tower a whole batch."""
        local = [int(num_examples(batch)) for batch in self.strategy.tower_values(batches)]
        return sum(local) * self.num_towers // max(len(local), 1)

    @staticmethod
    def tower_function(fn=None, *, reduce="mean", training=True):
        """Makes `fn` a data-parallel step: run once per tower, results reduced.

        Use it as a decorator on a method of a `kt.Trainer` or `kt.TowerModel`
        subclass, or call it on such a bound method
        (`Trainer.tower_function(self.step)`). The result takes what `fn` takes, per-tower values (what
        `next_batches()` returns) included; it runs `fn` once per tower,
        inside the tower's `TowerContext` and tower rules (see
        `TowerModel.tower_scope`), compiled with `tf.function`.

        `fn` returns a dict of values; each is reduced over towers:

        - `reduce="mean"`: the mean weighted by each tower's batch size (the
          first argument's, which must be a batch), right for per-batch mean
          losses; a plain mean when `fn` takes no argument.
        - `reduce="sum"`: the sum (float64 while summing, for exact counts).
        - `reduce=None`: a list with each tower's value, in tower order (the
          towers of this process: under Horovod, its own only).

        Args:
            fn: the tower function.
            reduce: "mean", "sum" or None.
            training: the TowerContext's `is_training`; in training the
                towers' replica-local weights follow the main tower's.
        """
        if reduce not in ("mean", "sum", None):
            raise ValueError(f'tower_function: reduce must be "mean", "sum" or None; got {reduce!r}.')
        if fn is None:
            return functools.partial(Trainer.tower_function, reduce=reduce, training=training)
        return _TowerFunction(fn, reduce, training)

    # ------------------------------------------------------------------
    # The loop.

    def train(
        self,
        callbacks=None,
        steps_per_epoch=None,
        starting_epoch=1,
        max_epoch=1,
        verbose="auto",
        logdir=None,
    ):
        """Runs epochs `starting_epoch..max_epoch` of `steps_per_epoch` iterations.

        Callbacks (kt and Keras ones, in one list) see `self.model`. With
        `kt.callbacks.AutoResume`, training goes on from the latest
        checkpoint's epoch, step and input position. Returns the model's
        `History`: per epoch, the mean of each value the steps logged.

        Args:
            callbacks: list of `kt.callbacks.Callback` and Keras callbacks.
            steps_per_epoch: iterations per epoch (required).
            starting_epoch: the first epoch_num, 1-based.
            max_epoch: the last epoch_num.
            verbose: 0 hides the progress bar.
            logdir: adds TensorBoard, JSONWriter and ThroughputTracker there.
        """
        steps_per_epoch = self._check_loop_arguments(steps_per_epoch, starting_epoch, max_epoch)
        if not self._is_set_up:
            with self.strategy.scope():
                self._setup()
            self._is_set_up = True
        self._check_optimizers_are_on_the_model()
        self.strategy.sync_initial_state(self.model)
        self.model._seed_towers_apart()
        callbacks = self.model._training_callbacks(
            callbacks, verbose, logdir, epochs=max_epoch, steps=steps_per_epoch
        )
        self._run_hooks = RunHooks(callbacks)
        fit_loop, self.model.loop = self.model.loop, self.loop
        self.model.stop_training = False
        self.model._resume_state = None
        self.loop.steps_per_epoch = steps_per_epoch
        self.loop.starting_epoch = starting_epoch
        self.loop.max_epoch = max_epoch
        self.loop.tower_batches = [0] * self.num_towers
        epoch_logs = None
        try:
            callbacks.on_train_begin()
            epoch_num, first_step = self._start_position(starting_epoch, steps_per_epoch)
            if self.input is not None:
                skip = self.loop.tower_batches if any(self.loop.tower_batches) else None
                self._iterator = iter(self.input.distribute(self.strategy, skip_batches=skip))
            for epoch_num in range(epoch_num, max_epoch + 1):
                epoch_logs = self._run_epoch(callbacks, epoch_num, first_step, steps_per_epoch)
                first_step = 0
                if self.model.stop_training:
                    break
        except StopTraining as stop:
            io_utils.print_msg(
                f"{type(self).__name__}: training was stopped at global step "
                f"{self.global_step}{': ' + str(stop) if str(stop) else ''}."
            )
            self._after_train(callbacks, epoch_logs)
        except BaseException:
            self._after_train(callbacks, epoch_logs, failed=True)
            raise
        else:
            self._after_train(callbacks, epoch_logs)
        finally:
            self.model.loop = fit_loop
            self._iterator = None
        return self.model.history

    def _run_epoch(self, callbacks, epoch_num, first_step, steps_per_epoch):
        self.loop.epoch_num = epoch_num
        self.loop.local_step = first_step
        sums, counts = {}, {}
        callbacks.on_epoch_begin(epoch_num - 1)
        for step in range(first_step, steps_per_epoch):
            callbacks.on_train_batch_begin(step)
            self._step_logs = {}
            returned = self.run_step()
            logs = pythonify_logs(returned if isinstance(returned, dict) else self._step_logs)
            self.loop.iterations += 1
            self.loop.local_step = step + 1
            for name, value in logs.items():
                sums[name] = sums.get(name, 0.0) + float(np.mean(value))
                counts[name] = counts.get(name, 0) + 1
            callbacks.on_train_batch_end(step, logs)
            if self.model.stop_training:
                break
        epoch_logs = {name: sums[name] / counts[name] for name in sums}
        callbacks.on_epoch_end(epoch_num - 1, epoch_logs)
        return epoch_logs

    def _after_train(self, callbacks, logs, failed=False):
        if not failed:
            try:
                callbacks.on_train_end(logs)
            except StopTraining:
                pass
            return
        try:
            callbacks.on_train_end(logs)
        except Exception as error:  # the training error is the one to report
            warnings.warn(
                f"kerastower: a callback failed in on_train_end while training "
                f"was failing: {type(error).__name__}: {error}"
            )

    def _start_position(self, starting_epoch, steps_per_epoch):
        """(epoch_num, first local step), and the loop counters, from the
        checkpoint AutoResume restored in on_train_begin, if any."""
        state = self.model._resume_state
        if state is None:
            return starting_epoch, 0
        self.loop.iterations = state["global_step"]
        self.loop.tower_batches = list(state["tower_batches"])
        if state["steps_per_epoch"] != steps_per_epoch:
            # Another epoch length: go on with the epoch after the saved one.
            io_utils.print_msg(
                f"{type(self).__name__}: the checkpoint was written with "
                f"steps_per_epoch={state['steps_per_epoch']}; with {steps_per_epoch} "
                f"now, training goes on at epoch {state['epoch_num'] + 1}, step 0."
            )
            return state["epoch_num"] + 1, 0
        if state["local_step"] < steps_per_epoch:
            return state["epoch_num"], state["local_step"]
        return state["epoch_num"] + 1, 0

    def _check_optimizers_are_on_the_model(self):
        saved = training_optimizers(self.model)
        for name, value in sorted(vars(self).items()):
            if isinstance(value, keras.optimizers.Optimizer) and all(value is not o for o in saved):
                raise KerasTowerError(
                    f"{type(self).__name__}.{name} is an optimizer held by the trainer: "
                    "checkpoints save, and Horovod broadcasts, only what the model "
                    f"holds. Set it on the model instead (self.model.{name} = ...)."
                )

    def _check_loop_arguments(self, steps_per_epoch, starting_epoch, max_epoch):
        if not isinstance(steps_per_epoch, (int, np.integer)) or steps_per_epoch < 1:
            raise ValueError(
                f"{type(self).__name__}.train: steps_per_epoch must be a positive "
                f"int (iterations between epoch callbacks); got {steps_per_epoch!r}."
            )
        if not isinstance(starting_epoch, int) or starting_epoch < 1:
            raise ValueError(
                f"{type(self).__name__}.train: starting_epoch is 1-based; got {starting_epoch!r}."
            )
        if not isinstance(max_epoch, int) or max_epoch < starting_epoch - 1:
            raise ValueError(
                f"{type(self).__name__}.train: max_epoch must be an int >= "
                f"starting_epoch - 1 = {starting_epoch - 1}; got {max_epoch!r}."
            )
        return int(steps_per_epoch)


class _TowerFunction:
    """What `Trainer.tower_function` makes; a descriptor, so that it also
    decorates methods (each instance gets its own compiled function)."""

    def __init__(self, fn, reduce, training, owner=None):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.reduce = reduce
        self.training = training
        # A bound method of a trainer or model knows whose strategy runs it.
        self.owner = owner if owner is not None else getattr(fn, "__self__", None)
        self._compiled = None

    def __get__(self, instance, owner_class=None):
        if instance is None:
            return self
        # One compiled function per instance and per definition: a subclass
        # overriding a tower function can still call super()'s.
        bound_functions = instance.__dict__.setdefault("_kerastower_tower_functions", {})
        bound = bound_functions.get(id(self))
        if bound is None:
            bound = _TowerFunction(
                functools.partial(self.fn, instance), self.reduce, self.training, owner=instance
            )
            bound.__name__ = getattr(self.fn, "__name__", "tower_function")
            bound.__qualname__ = getattr(self.fn, "__qualname__", bound.__name__)
            bound_functions[id(self)] = bound
        return bound

    def _model(self):
        owner = self.owner
        model = owner if isinstance(owner, TowerModel) else getattr(owner, "model", None)
        if not isinstance(model, TowerModel):
            raise KerasTowerError(
                f"tower_function {self.__name__!r} cannot find the kt.TowerModel "
                "whose strategy runs it: decorate a method of a kt.Trainer or of "
                "a kt.TowerModel."
            )
        return model

    def __call__(self, *args):
        if self._compiled is None:
            self._compiled = self._make(self._model())
        return self._compiled(*args)

    def _make(self, model):
        strategy = model.tower_strategy
        reduce = self.reduce
        name = getattr(self, "__qualname__", self.__name__)

        def in_tower(*args):
            examples = _batch_size(args[0]) if args else None
            with model.tower_scope(self.training, name, examples=examples):
                outputs = self.fn(*args)
            if not isinstance(outputs, dict):
                raise KerasTowerError(
                    f"tower_function {name!r} must return a dict of values to "
                    f"reduce over towers; got {type(outputs).__name__}."
                )
            if reduce != "mean":
                return outputs, tf.constant(1.0, tf.float64)
            if args and examples is None:
                raise KerasTowerError(
                    f"tower_function {name!r} with reduce=\"mean\" weights each tower's "
                    "values by the batch size of its first argument, which is not a batch "
                    f"(got {args[0]!r}). Pass the tower's batch first, or use "
                    "reduce=\"sum\" or None."
                )
            weight = tf.cast(1 if examples is None else examples, tf.float64)
            return {k: tf.cast(v, tf.float64) * weight for k, v in outputs.items()}, weight

        def run(*args):
            outputs, weights = strategy.run(in_tower, args=args)
            if reduce is None:
                return {k: strategy.tower_values(v) for k, v in outputs.items()}
            sums = {k: strategy.sum_over_towers(v) for k, v in outputs.items()}
            if reduce == "mean":
                total = strategy.sum_over_towers(weights)
                sums = {k: tf.math.divide_no_nan(v, total) for k, v in sums.items()}
            return sums

        if model.run_eagerly:
            return run
        return tf.function(run, reduce_retracing=True)


def _batch_size(batch):
    """The number of examples in a tower's batch, or None when it is not one."""
    first = next((t for t in tf.nest.flatten(batch) if t is not None), None)
    try:
        tensor = tf.convert_to_tensor(first)
    except (TypeError, ValueError):
        return None
    if tensor.shape.rank == 0:
        return None
    return tf.shape(tensor)[0]
