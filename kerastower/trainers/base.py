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

class Counter(kt.Trainer):            # anything that runs in a loop: no model
    def _setup(self):
        self.count = self.add_variable("count")   # checkpointed, resumed

    def run_step(self):
        self.count.assign_add(1.0)

counter = Counter()
counter.train(steps_per_epoch=3, max_epoch=2, verbose=0)
assert float(counter.count.numpy()) == 6.0
```
"""

import contextlib
import functools

import keras
import numpy as np

from kerastower import _compat
from kerastower.arguments import integer
from kerastower.model import TowerModel
from kerastower.errors import InputSourceError
from kerastower.errors import KerasTowerError
from kerastower.loop.main_loop import Iteration
from kerastower.loop.main_loop import LoopState
from kerastower.loop.main_loop import MainLoop
from kerastower.loop.main_loop import announce_total_batch
from kerastower.loop.main_loop import StopTraining
from kerastower.loop.main_loop import training_callbacks
from kerastower.loop.run import TrainingRun
from kerastower.callbacks.base import RunHooks
from kerastower.checkpoint.training_state import training_optimizers
from kerastower.trainers.feeds import feed_for
from kerastower.trainers.tower_function import TowerFunction

__all__ = ["Trainer", "StopTraining"]


class _TrainerState(TowerModel):
    """What a trainer without a model registers its variables on: callbacks
    see it as `self.model`, checkpoints save its variables."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.optimizer = None  # callbacks that log the learning rate ask for it


class Trainer:
    """Runs `run_step()` in epochs of `steps_per_epoch` iterations, with callbacks.

    Args:
        model: optional `kt.TowerModel` being trained: what callbacks see as
            `self.model`, what checkpoints save (its variables and those of
            every optimizer it holds). Create it under the strategy to train
            with; the trainer runs on the model's strategy. Without one, the
            trainer runs on the current strategy, and the variables it makes
            with `add_variable` are what checkpoints save.
        input: optional `kt.InputSource` or `tf.data.Dataset` (batched per
            tower, and endless: an epoch does not end the data); on JAX a
            Python generator or iterable of batches or a
            `keras.utils.PyDataset` (trainers/feeds.py).
            `next_batches()` takes one batch per tower from it.
        train_op: optional callable; the default `run_step()` calls it
            through the hooked path. Subclasses override `run_step()` instead.

    Attributes:
        loop: the `kt.LoopState`, whose `global_step` counts iterations.

    Examples:
        >>> class Counter(kt.Trainer):
        ...     def _setup(self):
        ...         self.count = self.add_variable("count")   # checkpointed, resumed
        ...     def run_step(self):
        ...         self.count.assign_add(1.0)
        >>> counter = Counter()
        >>> _ = counter.train(steps_per_epoch=3, max_epoch=2, verbose=0)
        >>> float(counter.count.numpy()), counter.global_step
        (6.0, 6)
    """

    def __init__(self, model=None, input=None, train_op=None):
        if model is None:
            model = _TrainerState(name=f"{type(self).__name__.lower()}_state")
        if not isinstance(model, TowerModel):
            raise TypeError(
                f"{type(self).__name__} trains a kt.TowerModel; got "
                f"{type(model).__name__}. Subclass kt.TowerModel (or use "
                "kt.TowerModel(model)) so callbacks and checkpoints can find "
                "its variables and loop state."
            )
        self.model = model
        self.strategy = model.tower_strategy
        self.input = input
        self._feed = feed_for(input, type(self).__name__)
        self.train_op = train_op
        self.loop = LoopState()
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

    def add_variable(self, name, shape=(), dtype="float32", initializer="zeros"):
        """A variable of the trainer's state, kept on `self.model`: it is
        checkpointed, resumed, and broadcast to every process at start.
        Call it from `_setup()` (or before `train()`)."""
        with self.strategy.scope():
            return self.model.add_weight(
                shape=shape, dtype=dtype, initializer=initializer, name=name, trainable=False
            )

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
        step = self._feed.next(self.strategy)
        if step is None:
            raise InputSourceError(
                f"The input ran out at global step {self.global_step} (epoch "
                f"{self.epoch_num}, step {self.local_step}). An epoch is only the "
                "period at which callbacks run and the input must not end: repeat it "
                "(.repeat() on a dataset, a generator that loops).")
        batches, tower_examples = step
        self.loop.tower_batches = [n + 1 for n in self.loop.tower_batches]
        self.loop.examples_seen += sum(tower_examples)
        if not self._announced:
            self._announced = True
            announce_total_batch(self.strategy, self._verbose, tower_examples)
        return batches

    @staticmethod
    def tower_function(fn=None, *, reduce="mean", training=True):
        """Makes `fn` a data-parallel step: run once per tower, results reduced.

        Use it as a decorator on a method of a `kt.Trainer` or `kt.TowerModel`
        subclass, or call it on such a bound method
        (`Trainer.tower_function(self.step)`). The result takes what `fn` takes, per-tower values (what
        `next_batches()` returns) included; it runs `fn` once per tower,
        inside the tower's `TowerContext` and tower rules (see
        `TowerModel.tower_scope`), compiled with `tf.function` (on JAX: one
        `jax.jit` over the towers, backend/jax/tower_function.py).

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
        return TowerFunction(fn, reduce, training)

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

        The loop is `fit`'s (kerastower/loop/main_loop.py): the same callback order,
        StopTraining, on_train_end on failure, and resume. Callbacks (kt and
        Keras ones, in one list) see `self.model`. With
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
        steps_per_epoch, starting_epoch, max_epoch = self._check_loop_arguments(
            steps_per_epoch, starting_epoch, max_epoch
        )
        if not self._is_set_up:
            with self.strategy.scope():
                self._setup()
            self._is_set_up = True
        self._check_optimizers_are_on_the_model()
        self._build_compiled_optimizer()
        run = TrainingRun(self.model, self.loop, type(self).__name__)
        reading = contextlib.nullcontext() if self._feed is None else self._feed.reading()
        try:
            with run.training(), reading:
                # Callbacks set up here see the trainer's loop as `model.loop`.
                run.callbacks = callbacks = training_callbacks(
                    self.model, self.loop, callbacks, verbose, logdir, epochs=max_epoch,
                    steps=steps_per_epoch)
                self._run_hooks = RunHooks(callbacks)
                self._verbose, self._announced = verbose, False
                MainLoop(run).run(_RunSteps(self), starting_epoch, max_epoch, steps_per_epoch)
        finally:
            self._iterator = None
        return self.model.history

    def _build_compiled_optimizer(self):
        # As fit does: the optimizer given to compile() updates the model's
        # trainable variables; its slots must exist before any tower runs.
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not optimizer.built and self.model.built:
            with self.strategy.scope():
                optimizer.build(self.model.trainable_variables)

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
        owner = f"{type(self).__name__}.train"
        steps_per_epoch = integer(steps_per_epoch, "steps_per_epoch", owner, minimum=1)
        starting_epoch = integer(starting_epoch, "starting_epoch (1-based)", owner, minimum=1)
        max_epoch = integer(max_epoch, "max_epoch", owner, minimum=starting_epoch - 1)
        return steps_per_epoch, starting_epoch, max_epoch


class _RunSteps(Iteration):
    """A trainer's iteration: its `run_step()`; epoch logs are the mean of
    each value the steps logged."""

    def __init__(self, trainer):
        self.trainer = trainer

    def start(self, skip_batches, epoch_num):
        trainer = self.trainer
        if trainer._feed is not None:
            trainer._feed.open(trainer.model.engine, skip_batches)
            trainer._iterator = trainer._feed.iterator

    def before_epoch(self, loop):
        self.sums, self.counts = {}, {}

    def run(self, num_steps):
        trainer = self.trainer
        trainer._step_logs = {}
        returned = trainer.run_step()
        logs = _compat.pythonify_logs(returned if isinstance(returned, dict) else trainer._step_logs)
        for name, value in logs.items():
            self.sums[name] = self.sums.get(name, 0.0) + float(np.mean(value))
            self.counts[name] = self.counts.get(name, 0) + 1
        return 1, logs

    def epoch_logs(self, loop):
        return {name: self.sums[name] / self.counts[name] for name in self.sums}
