"""What an iteration of `TowerModel.fit` is: one call of the compiled tower step.

`MainLoop` (main_loop.py) runs the epochs and the callbacks; `FitSteps` runs up
to `steps_per_execution` steps per call on the per-tower input, keeps the
input position, and adds validation to the epoch's logs.
"""

import warnings

import keras

from kerastower import _compat
from kerastower.callbacks.base import Callback as KtCallback
from kerastower.callbacks.base import RunHooks
from kerastower.callbacks.base import unwrapped
from kerastower.callbacks.monitors import ProgressBar
from kerastower.errors import nonfinite_error
from kerastower.errors import InputSourceError
from kerastower.inputs import python_sources
from kerastower.inputs.keras_order import order_kind
from kerastower.loop.batch_hooks import BatchHooks
from kerastower.loop.batch_hooks import progress_bar_steps
from kerastower.loop.main_loop import Iteration
from kerastower.loop.main_loop import announce_total_batch

__all__ = ["FitSteps"]


class FitSteps(Iteration):
    """fit's iteration over `source`, with optional validation.

    Args:
        model: the TowerModel.
        source: the InputSource to train on.
        callbacks: the run's CallbackList (its kt callbacks see every call
            of the step function as a hooked run).
        steps_per_epoch: None makes an epoch one pass over `source`.
        validation: None, or a dict of `evaluate` arguments plus `freq`.
        verbose: 0 keeps the total-batch line quiet.
    """

    def __init__(self, model, source, callbacks, steps_per_epoch, validation=None, verbose=1):
        self.model = model
        self.source = source
        self.callbacks = callbacks
        self.steps_per_epoch = steps_per_epoch
        self.validation = validation
        self.verbose = verbose
        self.steps_per_call = model.steps_per_execution
        self.logs = {}
        self.final_logs = None  # StepRun.final_logs of the last steps
        self._announced = False
        self.failure = None
        self._unsettled = None  # (the StepRun counted, its `settle`)

    def batch_hooks(self):
        callbacks = self.callbacks
        callbacks = getattr(callbacks, "callbacks", callbacks or [])
        # Read at each epoch's start, after on_train_begin and on_epoch_begin,
        # where a callback may add another to the list.
        self.run_hooks = RunHooks(callbacks)
        terminate_on_nan = [unwrapped(callback) for callback in callbacks
                            if isinstance(unwrapped(callback), keras.callbacks.TerminateOnNaN)]
        self.terminate_on_nan = bool(terminate_on_nan)
        # Keras 3.15's TerminateOnNaN(raise_error=True) raises instead.
        self.nan_raises = any(getattr(c, "raise_error", False) for c in terminate_on_nan)
        # Where no callback reads a step before the epoch's end (a progress
        # bar only shows it), a call may come back before its finite flags
        # are read (`StepRun.settle`): they are read once the next call is
        # launched, or at the epoch's end. One process only, so that every
        # process stops at the same point of the loop. Decided here, after
        # on_train_begin and each on_epoch_begin, as the hooks are: a
        # callback may set a hook, or add a callback, there.
        reads_steps = any(map(_reads_steps, callbacks))
        self.feed.flags_read_late = self.model.tower_strategy.single_process and not reads_steps
        if reads_steps:
            # A reader added to the list since Keras chose to run its batch
            # hooks in a thread must see the step it is called for.
            _compat.run_train_batch_hooks_in_loop(self.callbacks)
        # Keras's own CallbackList, none of whose callbacks has a batch hook:
        # calling its batch hooks would do nothing but hand each step's logs
        # to a thread. Where kerastower's progress bar alone has one, the
        # steps it may draw only.
        shows = progress_bar_steps(self.callbacks, ProgressBar, _has_batch_hooks)
        if shows is not None:
            return BatchHooks(self.callbacks, shows)
        return (type(self.callbacks) is not keras.callbacks.CallbackList
                or any(map(_has_batch_hooks, callbacks)))

    @property
    def tower_batch_size(self):
        rows = getattr(self.source, "rows", None)  # numpy arrays (inputs/array_rows.py)
        return None if rows is None else rows.batch_size

    @property
    def array_order(self):
        rows = getattr(self.source, "rows", None)  # numpy arrays; else a PyDataset's order
        return order_kind(self.source if rows is None else rows, self.model.engine.backend)

    def start(self, skip_batches, epoch_num):
        self.feed = self.model.engine.fit_feed(self.source, self.steps_per_epoch, self.steps_per_call)
        self.feed.start(skip_batches, epoch_num)

    def before_epoch(self, loop):
        if not self.steps_per_epoch and loop.steps_per_epoch == 0:
            self._warn_no_batch()
        self.model.reset_metrics()
        self.loop = loop
        self.feed.begin_pass(loop)

    def epoch_begun(self, loop):
        if self.steps_per_epoch:  # a PyDataset's hook, by epoch as Keras times it
            python_sources.epoch_begins(self.source)

    def run(self, num_steps):
        self.run_hooks.before_run()
        try:
            run = self.feed.run(num_steps, self.loop)
        except Exception:
            # The call before failed first: that is the error to report.
            if self._settled_failure(self.loop):
                self.ended_early(self.loop, self.loop.local_step)
            raise
        self.run_hooks.after_run(run.logs)
        if self._settled_failure(self.loop):
            # The call before this one was not finite: this one (gated on
            # the devices) changed nothing, and the loop stops (ended_early).
            return 0, self.logs
        if run.nonfinite_towers is not None:
            # The loop counts the steps before the failed one, then
            # ended_early raises.
            self.failure = (self.loop.global_step + run.done + 1, run.nonfinite_towers)
        if run.taken:
            # The step function's logs are the metrics read across towers
            # (and processes); the model's own read would be this process's.
            self.logs, self.final_logs = run.logs, run.final_logs
            self.loop.tower_batches = [int(a) + int(b) for a, b in zip(self.loop.tower_batches, run.tower_batches)]
            self.loop.examples_seen += run.examples
            self._announce_total_batch(run.tower_examples)
        if run.settle is not None:
            self._unsettled = (run, run.settle)
        return run.done, self.logs

    def _settled_failure(self, loop):
        """Reads the finite flags of the call the feed left unread
        (`flags_read_late`; the call after it, if any, is already
        launched): if a step's were not finite, the loop's counts go back to
        that step (nothing read them in between), and True says that
        training stops there."""
        if self._unsettled is None:
            return False
        (counted, settle), self._unsettled = self._unsettled, None
        run = settle()
        if run.nonfinite_towers is None:
            return False
        undone = counted.done - run.done
        loop.local_step -= undone
        loop.global_step -= undone
        loop.tower_batches = [int(n) - (a - b) for n, a, b in
                              zip(loop.tower_batches, counted.tower_batches, run.tower_batches)]
        loop.examples_seen -= counted.examples - run.examples
        loop.epoch_ended = False
        self.logs, self.final_logs = run.logs, run.final_logs
        self.failure = (loop.global_step + 1, run.nonfinite_towers)
        return True

    _warned_no_batch = False

    def _warn_no_batch(self):
        """An epoch of one pass over an input of known length 0 (numpy
        arrays of no example, a tf.data.Dataset of no batch): stock Keras
        returns an empty history; so does fit here, saying so once. (An
        input found empty while read raises InputSourceError.)"""
        if self._warned_no_batch:
            return
        self._warned_no_batch = True
        kind = type(getattr(self.source, "dataset", None) or self.source).__name__
        warnings.warn(
            f"kerastower: fit trained nothing: the input gave no batch (its length is 0; "
            f"source {kind}). Check that x holds examples, that a tf.data.Dataset was not "
            "filtered or batched (drop_remainder=True with fewer examples than the batch "
            "size) to nothing, and that a PyDataset's __len__ is not 0. The weights are "
            "unchanged.", stacklevel=2)

    def ended_early(self, loop, step):
        if self.failure is not None:
            error = nonfinite_error(*self.failure, self.model.num_towers)
            if self.nan_raises:
                # Keras's own error, at the batch whose update was not
                # applied: the weights are the last finite step's.
                raise RuntimeError(
                    f"NaN or Inf loss encountered at batch {loop.local_step}. Loss value: "
                    f"not finite ({error}). Terminating training immediately.") from error
            if not self.terminate_on_nan:
                raise error
            # Keras's TerminateOnNaN asks for a normal end.
            _compat.print_msg(f"{error} TerminateOnNaN ends training.")
            self.model.stop_training = True
            return
        if self.steps_per_epoch:
            raise InputSourceError(
                f"The input ran out after {step} of steps_per_epoch="
                f"{self.steps_per_epoch} steps in epoch {loop.epoch_num}. With "
                "steps_per_epoch set, an epoch is only the period at which "
                "callbacks run, every step takes one batch per tower "
                f"({self.model.num_towers}), and the input must not end: call "
                ".repeat() on a tf.data.Dataset, make a generator loop forever, "
                "or leave steps_per_epoch unset to make an epoch one pass over "
                "the data."
            )
        if step == 0:
            raise InputSourceError(
                "The input gave no batch at all: it is empty, or (with "
                "steps_per_epoch unset) it was a one-shot source already used up."
            )

    def epoch_logs(self, loop):
        # A non-finite step's outputs are its inputs: the state may be
        # synced before its flags are read.
        self.model.engine.sync_state()  # epoch-end callbacks and validation read the weights
        if self._settled_failure(loop):
            self.ended_early(loop, loop.local_step)
        # As Keras, whose epoch iterator a stop_training break leaves unfinished.
        python_sources.epoch_ends(self.source, not self.model.stop_training and (
            not self.steps_per_epoch or loop.local_step >= self.steps_per_epoch))
        logs = self._logs_of_every_tower()
        if self.failure is not None and loop.local_step == 0:
            # TerminateOnNaN ended an epoch none of whose steps was applied:
            # it measured nothing (its metrics are back to zero, not a best).
            logs = {key: float("nan") for key in logs}
        validation = self.validation
        if validation is not None and _due(loop.epoch_num - 1, validation["freq"]):
            values = self.model.evaluate(
                validation["source"],
                steps=validation["steps"],
                callbacks=self.callbacks,
                return_dict=True,
                _from_fit=True,
            )
            logs.update({f"val_{k}": v for k, v in values.items()})
        return logs

    def _logs_of_every_tower(self):
        # As Keras's `_get_metrics_result_or_logs`: the metrics, where the
        # step returned exactly their keys (StepRun.final_logs).
        logs = self.logs if self.final_logs is None else self.final_logs
        return self.model.engine.logs_of_every_tower(logs)

    def finish(self):
        model = self.model
        if model.optimizer is not None and hasattr(model.optimizer, "finalize_variable_values"):
            model.optimizer.finalize_variable_values(model.trainable_weights)

    def _announce_total_batch(self, tower_examples):
        if not self._announced:
            self._announced = True
            announce_total_batch(self.model.tower_strategy, self.verbose, tower_examples)


_PROGRESS_BARS = (keras.callbacks.ProgbarLogger, ProgressBar)

_BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")


def _has_batch_hooks(callback):
    """Whether the loop must call `callback` between an epoch's steps: a kt
    callback (its triggers and run hooks), or a Keras callback with a batch
    hook of its own."""
    if isinstance(callback, KtCallback):
        return True
    # The bound hook, not the class's: LambdaCallback sets its hooks on the
    # instance.
    return any(getattr(getattr(callback, hook, None), "__func__", None)
               is not getattr(keras.callbacks.Callback, hook) for hook in _BATCH_HOOKS)


def _reads_steps(callback):
    """Whether `callback` may read the model, or act on a step, between an
    epoch's steps: any callback with batch hooks but a progress bar (Keras's
    `ProgbarLogger` or kerastower's `ProgressBar`, not a subclass), which
    only shows each step's logs. On JAX a progress bar may so show the
    logs of a step whose gradients turn out not finite, just before
    training stops at that step."""
    if type(callback) in _PROGRESS_BARS:
        return False
    return _has_batch_hooks(callback)


def _due(epoch, validation_freq):
    """Keras's rule: validate every `freq` epochs, or in the listed ones."""
    if isinstance(validation_freq, int):
        return (epoch + 1) % validation_freq == 0
    return epoch + 1 in validation_freq
