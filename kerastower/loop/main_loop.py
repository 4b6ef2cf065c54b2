"""The one training loop, shared by `TowerModel.fit` and `kt.Trainer.train`.

Training is running some iterations:

    for epoch_num in range(starting_epoch, max_epoch + 1):
        for local_step in range(steps_per_epoch):
            run_step()

and an epoch is only the period at which callbacks run. `MainLoop` runs
that loop and schedules every callback around it; what an iteration is
comes from an `Iteration` (fit: one call of the compiled tower step, see
`fit_steps.py`; kt.Trainer: its `run_step()`). `epoch_num` is 1-based, as in
tensorpack; Keras callbacks get the 0-based `epoch_num - 1`.
"""

import os
import warnings

import keras

from kerastower import _compat
from kerastower.callbacks.defaults import TENSORBOARD_KINDS
from kerastower.callbacks.defaults import with_default_monitors
from kerastower.callbacks.base import Callback as KtCallback
from kerastower.callbacks.base import KERAS_CHIEF_ONLY
from kerastower.errors import StrategyError
from kerastower.loop.batch_hooks import batch_hooks
from kerastower.loop.resume import Resumption

__all__ = ["LoopState", "MainLoop", "Iteration", "StopTraining", "training_callbacks"]


class StopTraining(Exception):
    """Raise it from a step or from a callback to end training now.

    The loop stops at once (the current epoch does not finish), every
    callback's `_after_train` runs, and `fit` / `train()` return normally.

    Examples:
        >>> class TenSteps(kt.Trainer):
        ...     def run_step(self):
        ...         if self.global_step == 10:
        ...             raise kt.StopTraining("ten steps are enough")
        >>> trainer = TenSteps()
        >>> _ = trainer.train(steps_per_epoch=4, max_epoch=5, verbose=0)
        TenSteps: training was stopped at global step 10: ten steps are enough.
        >>> trainer.global_step
        10
    """


class LoopState:
    """The counters of the training loop, readable from any callback.

    Attributes:
        starting_epoch: the first epoch_num of this run (1-based).
        max_epoch: the last epoch_num (Keras's `epochs`).
        steps_per_epoch: steps in an epoch, or None when an epoch is one pass
            over data of unknown length.
        epoch_num: the current (or last) epoch, 1-based; 0 before training.
        local_step: steps done in the current epoch.
        global_step: steps done, continuous across epochs, calls and resumed
            runs. The loop counts them itself, so a step LossScaleOptimizer
            skips still counts.
        tower_batches: batches each tower has taken from the input in this
            run (since the current pass began, when an epoch is one pass):
            the input position a checkpoint records.
        examples_seen: examples trained on by all towers, in this process.
        epoch_ended: True from the end of an epoch's last step until the
            next epoch begins (checkpoints written then resume at the next).
        one_pass: True when an epoch is one pass over the input (fit without
            steps_per_epoch).
        training_failed: True while the callbacks' after_train runs for a
            training that raised (not for StopTraining).
        logdir: the run's log folder (`fit(logdir=...)`), or None: where
            callbacks without a folder of their own write (MinSaver).
        batch_size: examples in each tower's batch when the input is numpy
            arrays (fit's `batch_size`); None when the source batches itself.

    Examples:
        >>> class PrintWhere(keras.callbacks.Callback):
        ...     def on_epoch_end(self, epoch, logs=None):
        ...         loop = self.model.loop
        ...         print(loop.epoch_num, loop.local_step, loop.global_step)
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> _ = model.fit(np.ones((12, 3)), np.ones((12, 1)), batch_size=4, epochs=2,
        ...               verbose=0, callbacks=[PrintWhere()])
        1 3 3
        2 3 6
    """

    def __init__(self):
        self.global_step = 0
        self.starting_epoch = 1
        self.max_epoch = 0
        self.steps_per_epoch = None
        self.epoch_num = 0
        self.local_step = 0
        self.tower_batches = []
        self.examples_seen = 0
        self.epoch_ended = False
        self.one_pass = False
        self.training_failed = False
        self.logdir = None
        self.batch_size = None
        self.array_order = None

    def __repr__(self):
        return (
            f"LoopState(epoch_num={self.epoch_num}, local_step={self.local_step}, "
            f"global_step={self.global_step}, steps_per_epoch={self.steps_per_epoch}, "
            f"starting_epoch={self.starting_epoch}, max_epoch={self.max_epoch})"
        )


class Iteration:
    """What one iteration of the loop is: the part fit and kt.Trainer differ in.

    `run(num_steps)` runs up to `num_steps` steps through the hooked path and
    returns (steps run, their logs); fewer than asked means the input ended.
    """

    steps_per_call = 1
    tower_batch_size = None  # examples in a tower's batch of numpy arrays, else None
    array_order = None  # what orders shuffled numpy arrays (keras_order.order_kind), else None

    def start(self, skip_batches, epoch_num):
        """Before the first epoch (`epoch_num`): open the input, skipping
        `skip_batches` (batches each tower took before a resume, counted from
        the pass's start when an epoch is one pass; None for a fresh start)."""

    def before_epoch(self, loop):
        """At the start of every epoch, before the callbacks' hooks."""

    def epoch_begun(self, loop):
        """After the callbacks' `on_epoch_begin`, before the epoch's first step."""

    def run(self, num_steps):
        raise NotImplementedError

    def batch_hooks(self):
        """Whether the callbacks' batch hooks are called in the epoch
        starting (False only where none of them has one), or for which
        steps (a `batch_hooks.BatchHooks`)."""
        return True

    def ended_early(self, loop, step):
        """The input ended after `step` steps of the epoch: raise if that is an error."""

    def epoch_logs(self, loop):
        """The epoch's logs, given to on_epoch_end."""
        return {}

    def finish(self):
        """After the last epoch, before on_train_end."""


def announce_total_batch(strategy, verbose, tower_examples):
    """The start line of a training run, on the chief: the towers, each
    one's batch (`tower_examples`, by tower) and the total batch."""
    if verbose == 0 or not strategy.is_chief:
        return
    counts = [int(n) for n in tower_examples]
    if len(set(counts)) == 1:
        per_tower = f"{len(counts)} tower(s) x {counts[0]} examples"
    else:
        per_tower = f"towers took {', '.join(map(str, counts))} examples"
    _compat.print_msg(f"kerastower: {per_tower} = total batch {sum(counts)} per step")


def callbacks_for_this_process(strategy, callbacks):
    """Drops `chief_only` callbacks on processes that are not the chief.
    Keras's callbacks that write files or print count as chief-only."""
    if callbacks is None or strategy.is_chief:
        return callbacks
    return [
        cb for cb in callbacks
        if not getattr(cb, "chief_only", isinstance(cb, KERAS_CHIEF_ONLY))
    ]


def training_callbacks(model, state, callbacks, verbose, logdir, epochs, steps):
    """The CallbackList a training run calls: the user's callbacks with the
    default monitors, those of this process only, with a History. The run's
    log folder goes to its loop `state`."""
    state.logdir = None if logdir is None else os.fspath(logdir)
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    return keras.callbacks.CallbackList(
        callbacks_for_this_process(
            model.tower_strategy, with_default_monitors(callbacks, verbose, logdir)
        ),
        add_history=True,
        add_progbar=False,
        verbose=verbose,
        epochs=epochs,
        steps=steps,
        model=model,
    )


def check_strategy(model, method):
    """Refuses to run a model under another strategy than the one it was
    created under (its variables live on that strategy's devices)."""
    from kerastower.strategies import switch as strategies

    active = strategies.current_strategy()
    if strategies.is_explicit() and _placement(active) is not _placement(model.tower_strategy):
        same_kind = (
            " (another object of the same kind: each kt.distributed(...) call makes its "
            "own strategy, so enter one object, e.g. `towers = kt.distributed(...)`, for "
            "both)" if repr(active) == repr(model.tower_strategy) else ""
        )
        raise StrategyError(
            f"{method}() runs under {active} but this model was created under "
            f"{model.tower_strategy}{same_kind}. Create the model inside the same "
            "kt.distributed function or block that calls "
            f"{method}(), so its variables live on the towers that train it."
        )


def _placement(strategy):
    """What places a strategy's towers: its tf.distribute strategy on
    TensorFlow (wrappers of one are made anew), itself on JAX."""
    return getattr(strategy, "tf_strategy", strategy)


class MainLoop:
    """Runs an `Iteration` in epochs, with callbacks (tensorpack's main_loop).

    The order, for fit and kt.Trainer alike: AutoResume's checkpoint is
    restored on the chief and its variables and resume state broadcast to
    every process; on_train_begin; then per epoch on_epoch_begin, per step
    on_train_batch_begin, the hooked run, on_train_batch_end; then
    on_epoch_end with the epoch's logs; on_train_end at the end or when a
    StopTraining ends it. When training fails, the kt callbacks'
    after_train still runs (Keras callbacks' on_train_end does not: to
    Keras it means training completed), and the error is re-raised.
    What makes a run survive (its folders locked, the restore at start, a
    preemption stop after any step) is its `Resumption` (resume.py).

    Args:
        run: the `TrainingRun` (run.py): the model, the loop state the run
            counts in, its callbacks and its name. The caller runs the loop
            inside `run.training()`.
    """

    def __init__(self, run):
        self.resume = Resumption(run)
        self.training_run = run
        self.model = run.model
        self.loop = run.state
        self.callbacks = run.callbacks
        self.name = run.name
        self.strategy = run.strategy

    def run(self, iteration, starting_epoch, max_epoch, steps_per_epoch, epoch_length=None):
        """Trains epochs `starting_epoch..max_epoch` (1-based, inclusive).

        `steps_per_epoch` None makes an epoch one pass over the input (whose
        length, if known, is `epoch_length`).
        """
        model, loop = self.model, self.loop
        self.training_run.hand_to_callbacks()
        check_strategy(model, self.name)
        loop.starting_epoch = starting_epoch
        loop.max_epoch = max_epoch
        loop.steps_per_epoch = steps_per_epoch or epoch_length
        loop.one_pass = not steps_per_epoch
        loop.batch_size = iteration.tower_batch_size
        loop.array_order = iteration.array_order
        loop.tower_batches = [0] * model.num_towers
        model.stop_training = False
        loop.training_failed = False
        epoch_logs = None
        locks = self.resume.lock_folders()
        try:
            state = self.resume.restore()
            self.resume.train_begin(state)
            epoch_num, first_step, skip = self.resume.start_position(
                state, starting_epoch, steps_per_epoch)
            loop.starting_epoch = epoch_num
            iteration.start(skip, epoch_num)
            with self.resume.signal_watch():
                for epoch_num in range(epoch_num, max_epoch + 1):
                    epoch_logs = self._run_epoch(iteration, epoch_num, first_step, steps_per_epoch)
                    first_step = 0
                    self.resume.stop_if_preempted(epoch_end=True)
                    if model.stop_training:
                        break
            iteration.finish()
        except StopTraining as stop:
            _compat.print_msg(
                f"{self.name}: training was stopped at global step {loop.global_step}"
                f"{': ' + str(stop) if str(stop) else ''}."
            )
            self._after_train(epoch_logs)
        except BaseException:
            loop.training_failed = True
            self._after_train(epoch_logs, failed=True)
            raise
        else:
            self._after_train(epoch_logs)
        finally:
            self.resume.release(locks)

    def _run_epoch(self, iteration, epoch_num, first_step, steps_per_epoch):
        loop, callbacks, model = self.loop, self.callbacks, self.model
        loop.epoch_num = epoch_num
        loop.local_step = step = first_step
        loop.epoch_ended = False
        iteration.before_epoch(loop)
        callbacks.on_epoch_begin(epoch_num - 1)
        iteration.epoch_begun(loop)
        # Asked after on_train_begin and on_epoch_begin: a callback may set
        # a hook of its own there.
        hooks = batch_hooks(callbacks, iteration.batch_hooks())
        # A pass of known length ends after its last step, as in Keras: no
        # on_train_batch_begin for a step that the input cannot give.
        limit = steps_per_epoch or loop.steps_per_epoch
        while limit is None or step < limit:
            want = iteration.steps_per_call
            if limit:
                want = min(want, limit - step)
            hooks.begin(step)
            ran, logs = iteration.run(want)
            if ran:
                step += ran
                loop.local_step = step
                loop.global_step += ran
                hooks.end(step - 1, logs)
                self.resume.stop_if_preempted()
            if ran < want:
                iteration.ended_early(loop, step)
                break
            if model.stop_training:
                break
        hooks.epoch_end()
        loop.epoch_ended = True
        epoch_logs = iteration.epoch_logs(loop)
        with self.training_run.callback_pass():
            callbacks.on_epoch_end(epoch_num - 1, epoch_logs)
        return epoch_logs

    def _after_train(self, logs, failed=False):
        if not failed:
            try:
                self.callbacks.on_train_end(logs)
            except StopTraining:
                pass
            return
        # On failure, tensorpack's after_train runs (kt callbacks); Keras
        # callbacks keep Keras's contract, where on_train_end means training
        # completed (BackupAndRestore would delete its backup). TensorBoard's
        # only closes its writers, which would else stay the thread's
        # default summary writer after the failed run. Hooks Keras's list
        # still runs in its thread finish first: none runs after fit raised.
        try:
            _compat.end_async_batch_hooks(self.callbacks)
        except Exception as error:  # the training error is the one to report
            warnings.warn(f"kerastower: a batch hook failed while training was failing: "
                          f"{type(error).__name__}: {error}")
        for callback in getattr(self.callbacks, "callbacks", []):
            if not isinstance(callback, (KtCallback, *TENSORBOARD_KINDS)):
                continue
            try:
                callback.on_train_end(logs)
            except Exception as error:  # the training error is the one to report
                warnings.warn(
                    f"kerastower: {type(callback).__name__}.on_train_end failed while "
                    f"training was failing: {type(error).__name__}: {error}"
                )
