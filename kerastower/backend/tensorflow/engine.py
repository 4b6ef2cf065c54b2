"""The TensorFlow StepEngine: steps as `tf.function`s over `strategy.run`.

Sources are InputSources (kerastower/inputs/sources.py), placed on the
towers by `place` (the strategy's `place_input` under each source's
`distribute`); a step function (step.py) takes one batch per tower per
step (feeding.py) and runs the model's tower step on it under its
TowerContext.
"""

import contextlib
import weakref

import keras
import numpy as np
import tensorflow as tf

from kerastower import _compat

from kerastower.backend.engine import Feed
from kerastower.backend.engine import StepEngine
from kerastower.backend.engine import StepRun
from kerastower.backend.tensorflow import batch_checks
from kerastower.backend.tensorflow import feeding
from kerastower.backend.tensorflow.gradients import GradientPresence
from kerastower.backend.tensorflow.tower_function import TowerFunctionRunner
from kerastower.backend.tensorflow import step_calls
from kerastower.backend.tensorflow import step_errors
from kerastower.backend.tensorflow import xla
from kerastower.backend.tensorflow.inputs import as_input_source
from kerastower.errors import StrategyError
from kerastower.inputs import keras_order
from kerastower.inputs import preprocessing
from kerastower.inputs import python_sources
from kerastower.inputs import ragged_sparse
from kerastower.inputs.step_failures import StepFailures

__all__ = ["TensorFlowEngine"]


class StepCache:
    """What the step functions of one model remember between traces: one
    record per model, where module globals would outlive it.

    Attributes:
        local_weights: the replica-local weights that follow the main tower.
        last_gradients: the last eager step's gradients (run_eagerly: a tower
            without examples gives zeros shaped like them).
        collectives: what each step function launched (`kt.collectives_per_step`).
        read_logs: the function reading the metrics across towers.
        gradient_presence: which variables got a gradient on each tower.
        forward_collectives: whether a tower's forward pass all-reduces (a
            masked loss's divisor, `loss_divisors.py`): then no tower skips
            it, even on an empty batch.
    """

    def __init__(self):
        self.local_weights = None
        self.last_gradients = None
        self.collectives = {}
        self.read_logs = None
        self.gradient_presence = GradientPresence()
        self.forward_collectives = False


class TensorFlowEngine(StepEngine):
    """Runs a TowerModel's steps with `tf.distribute` (see StepEngine)."""

    backend = "tensorflow"
    pass_order = keras_order.KerasPassOrder

    def __init__(self, model):
        super().__init__(model)
        # Lists of variables set as model attributes would be tracked by Keras
        # as the model's own variables (reordering model.variables); the
        # engine, no Keras object, keeps these caches out of its sight.
        self.cache = StepCache()
        # What went wrong in the current run's steps that TensorFlow reports
        # as text only (a generator's exception, a tower's batch mismatch).
        self.failures = StepFailures()
        # Inference iterators whose every step has every tower's batch
        # (`open_inference`), held weakly: they go with their evaluation.
        self._filled_iterators = weakref.WeakSet()
        # Others' leading steps that give every tower a batch (arrays).
        self._filled_steps = weakref.WeakKeyDictionary()

    def keras_jit_compile(self, jit_compile):
        # Keras's own step functions, which would jit-compile the cross-tower
        # work too, are not used: ours compile the towers' part.
        return False

    def compiled(self, jit_compile):
        self.model.tower_jit_compile = xla.resolve(self.model, jit_compile)
        self.cache.read_logs = None  # it read the metrics compile replaced

    def input_source(self, x, y=None, sample_weight=None, batch_size=None, shuffle=False,
                     repeat=False, method="fit", steps=None):
        x, y, sample_weight, batch_size = preprocessing.preprocessed(
            self.model, x, y, sample_weight, batch_size, repeat=repeat)
        if method == "fit":
            source = as_input_source(x, y, sample_weight, batch_size, shuffle, repeat=repeat)
            if getattr(source, "rows", None) is not None:
                keras_order.follow_keras(source.rows, self.model.tower_strategy, self.pass_order)
                source.rows.fix_seed()
        elif method == "predict":
            source = as_input_source(x, batch_size=batch_size)
        else:
            source = as_input_source(x, y, sample_weight, batch_size)
        if not steps:
            _check_ends(source, method)
        python_sources.read_by(source, method, steps)  # a PyDataset's hooks depend on the call
        return preprocessing.ready(source) if preprocessing.preprocesses(self.model) else source

    def validation_source(self, validation_data, batch_size, steps=None):
        validation_data = preprocessing.preprocessed_validation(self.model, validation_data, batch_size)
        if isinstance(validation_data, (tuple, list)) and not isinstance(
            validation_data[0], tf.data.Dataset
        ):  # (x, y[, sample_weight]) arrays
            val_x, val_y, val_w = _compat.unpack_x_y_sample_weight(tuple(validation_data))
            source = as_input_source(val_x, val_y, val_w, batch_size)
        else:  # a dataset or an InputSource
            source = as_input_source(validation_data)
        if not steps:
            _check_ends(source, "fit", "validation_steps")
        return preprocessing.ready(source) if preprocessing.preprocesses(self.model) else source

    def build_for(self, source, step=None, with_targets=True):
        if step == "train":
            _check_gradient_accumulation(self.model)
        batch_checks.build_for(self.model, source, with_targets, step)

    def fit_feed(self, source, steps_per_epoch, steps_per_call):
        return _Feed(self.model, source, steps_per_epoch, steps_per_call)

    def place(self, source, pass_index=0, skip_batches=None):
        """The source's pipelines, placed on the towers by the strategy (a
        distributed dataset: iterate it once per pass, unless the source is
        pass-indexed, when each pass is placed afresh). The feeds it builds
        record their generators' errors into this engine's StepFailures."""
        kwargs = {"skip_batches": skip_batches}
        if getattr(source, "pass_indexed", False):
            kwargs["pass_index"] = pass_index
        with self.failures.feeding():
            return source.distribute(self.model.tower_strategy, **kwargs)

    def open_inference(self, source, steps=None):
        iterator = super().open_inference(source, steps)
        # As fit's steps (`fills_every_step`): where every step has every
        # tower's batch and no step is asked for past the pass's end, a
        # step need not ask whether data is left.
        strategy = self.model.tower_strategy
        if fills_every_step(source, strategy) and (
                steps is None or steps <= source.steps(self.model.num_towers)):
            self._filled_iterators.add(iterator)
        elif strategy.single_process and getattr(source, "rows", None) is not None:
            # Arrays: tower k of step s takes batch s*N+k, so every step
            # before the last batch's gives every tower one (`predict_step`).
            self._filled_steps[iterator] = source.rows.num_batches() // strategy.num_towers
        return iterator

    def test_steps(self, iterator, num_steps, first_step):
        filled = iterator in self._filled_iterators
        run = step_calls.run_steps(self.model.make_test_function(), iterator, num_steps,
                                f"Evaluation step {first_step + 1}", filled, failures=self.failures,
                                one_step_calls=filled and self.model.steps_per_execution == 1)
        return StepRun(taken=run.steps, done=run.steps, logs=run.logs, final_logs=run.final_logs)

    def joined_outputs(self, parts):
        # Keras's TensorFlow predict keeps ragged and sparse outputs so, and
        # joins outputs of different widths as ragged.
        if not all(map(_dense, parts)) or len({tuple(p.shape[1:]) for p in parts}) > 1:
            return _compat.tf_predictions_joined(parts)
        return None

    def predict_step(self, iterator, step):
        function = self.model.make_predict_function()
        from_iterator = getattr(function, "from_iterator", None)
        if from_iterator is not None and (iterator in self._filled_iterators
                                          or step < self._filled_steps.get(iterator, 0)):
            # Every step (this one) gives every tower a batch, and the loop
            # stops at the pass's known length: one graph call takes the
            # batches and predicts, where asking eagerly whether data is
            # left and then calling the step cost 2x stock Keras's step.
            return step_calls.run_predict_step(from_iterator, iterator, f"Prediction step {step + 1}",
                                               self.failures)
        try:
            has_data, next_batches = feeding.next_step(self.model.tower_strategy, iterator)
            if not bool(has_data):  # no tower has data left
                return None
            return function(next_batches())
        except tf.errors.OpError as error:
            failure = step_errors.explain(error, f"Prediction step {step + 1}", self.failures)
            raise failure from failure.__cause__

    def run_tower_function(self, tower_function, args):
        if tower_function.runner is None:
            tower_function.runner = TowerFunctionRunner(tower_function)
        return tower_function.runner(self.model, args)

    @contextlib.contextmanager
    def training_metrics_kept(self):
        strategy = self.model.tower_strategy
        copies = [
            copy
            for metric in self.model.metrics
            for variable in metric.variables
            for copy in strategy.tower_values(getattr(variable, "value", variable))
        ]
        saved = [tf.identity(copy) for copy in copies]
        try:
            yield
        finally:
            for copy, value in zip(copies, saved):
                copy.assign(value)

    def inference_sums(self, source, counters, compiled):
        model = self.model
        strategy = model.tower_strategy
        self.build_for(source, with_targets=False)
        iterator = iter(self.place(source))
        if compiled.get("sums") is None:

            def tower_sums(data):
                x, y, sample_weight = _compat.unpack_x_y_sample_weight(data)
                y_pred = model._call_tower(x, training=False)
                return [c._batch_sums(y, y_pred, sample_weight) for c in counters]

            def step(data):
                per_tower = model.run_on_towers(tower_sums, data)
                return tf.nest.map_structure(strategy.sum_over_towers, per_tower)

            # One trace for batches of any size: a process tracing again for
            # its short last batch would run another graph than the others,
            # whose collectives then never meet.
            signature = tf.nest.map_structure(_any_batch_size, iterator.element_spec)
            compiled["sums"] = tf.function(step, input_signature=[signature])
        totals = None
        while True:
            has_data, next_batches = feeding.next_step(strategy, iterator)
            if not bool(has_data):
                break
            sums = tf.nest.map_structure(np.float64, compiled["sums"](next_batches()))
            totals = sums if totals is None else tf.nest.map_structure(np.add, totals, sums)
        if totals is None:
            raise ValueError("InferenceRunner: the validation source gave no batch.")
        return totals

    def logs_of_every_tower(self, logs):
        if logs and not self.model.tower_strategy.single_process:
            # The steps gave this process's metrics; the result is all towers'.
            # (Values the step returned were reduced over every tower already.)
            across = step_calls.logs_across_towers(self.model)
            return {key: across.get(key, value) for key, value in logs.items()}
        return dict(logs)

    def memory_peaks(self):
        return [tf.config.experimental.get_memory_info(d)["peak"] for d in _gpus()]

    def reset_memory_peaks(self):
        for device in _gpus():
            tf.config.experimental.reset_memory_stats(device)

    def optimizer_state_bytes(self):
        # A mirrored variable holds a whole copy on each tower's device.
        held = {}
        tower_values = self.model.tower_strategy.tower_values
        for variable in self.model.optimizer.variables:
            for copy in tower_values(variable.value):
                size = copy.shape.num_elements() * copy.dtype.size
                held[copy.device] = held.get(copy.device, 0) + size
        return held

    def collectives_per_step(self, mode):
        recorded = self.cache.collectives
        launches = recorded.get(mode, {"step": [], "logs": []})
        result = {phase: list(items) for phase, items in launches.items()}
        if mode != "predict" and "read_logs" in recorded:
            result["logs"] += recorded["read_logs"]["step"]
        return result

    @contextlib.contextmanager
    def running(self, source=None):
        # An error a generator raised while no step ran (its dataset read
        # directly) is no step's.
        self.failures.clear()
        reading = contextlib.nullcontext() if source is None else source.reading()
        with batch_checks.original_errors(self.failures), reading:
            yield


def _dense(part):
    """Whether a step's output is a dense array of rank 1 or more."""
    return (isinstance(part, np.ndarray) or hasattr(part, "numpy")) and not (
        ragged_sparse.is_composite(part)) and len(part.shape) > 0


def _check_gradient_accumulation(model):
    """Gradient accumulation is exact on every TensorFlow strategy, where
    kerastower takes Keras's accumulate-or-apply choice itself
    (`_compat.accumulate_or_apply`), but not with a LossScaleOptimizer,
    whose own apply skips non-finite steps: refused before the step is
    traced."""
    steps = _compat.accumulation_steps(model.optimizer)
    if not steps or not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        return
    raise StrategyError(
        f"fit: the optimizer has gradient_accumulation_steps={steps} inside a "
        "LossScaleOptimizer (mixed precision), which kerastower does not accumulate on "
        "TensorFlow yet. Train with a larger batch per tower instead (towers x per-tower "
        "batch is the step's batch), or without the LossScaleOptimizer, or on JAX.")


def _check_ends(source, method, argument=None):
    """Refuses a Python source that never ends where `method` would read it
    to its end (a tf.data pipeline's end is checked when it is opened)."""
    python_source = getattr(source, "source", None)
    if getattr(source, "pass_indexed", False) and python_source is not None:
        python_source.check_finite(method, argument)


def _any_batch_size(spec):
    """A tensor's spec with any batch size; other specs as they are."""
    if isinstance(spec, tf.TensorSpec) and spec.shape.rank:
        return tf.TensorSpec([None] + spec.shape.as_list()[1:], spec.dtype, spec.name)
    return spec


def _gpus():
    return [d.name for d in tf.config.list_logical_devices("GPU")]


def fills_every_step(source, strategy, skip_batches=None):
    """Whether every step of fit's passes over `source` gives each of the
    strategy's towers a batch (`InputSource.fills_every_step`), the first
    pass resumed after `skip_batches` (each tower's) included."""
    total = strategy.num_towers
    # Within one process only: another process's shares are not known
    # here, and it may run out while this one goes on.
    if not strategy.single_process or not source.fills_every_step(total):
        return False
    # A resumed pass (perhaps saved on another number of towers) must
    # leave the towers equal shares too.
    return skip_batches is None or (len(skip_batches) == total and len(set(skip_batches)) == 1)


class _Feed(Feed):
    """fit's per-tower iterators over an InputSource."""

    def __init__(self, model, source, steps_per_epoch, steps_per_call):
        self.model = model
        self.source = source
        self.steps_per_epoch = steps_per_epoch
        self.steps_per_call = steps_per_call
        self.function = model.make_train_function()
        self.endless = False
        # Every step of a pass gives every tower a batch, and the loop stops
        # at the pass's known length: a step need not ask whether data is
        # left (`fills_every_step`), so calls of one step run straight.
        self.steps_have_data = False

    def start(self, skip_batches, epoch_num):
        strategy = self.model.tower_strategy
        # A Python source is distributed afresh for every pass, with its
        # index (its order is the pass's); a tf.data pipeline draws each
        # pass's order when an iterator of it is made.
        self.by_pass = getattr(self.source, "pass_indexed", False)
        if self.steps_per_epoch:
            # Every process must agree, or one would wait in a collective
            # the others skip.
            self.endless = strategy.all_agree(self.source.endless(strategy.num_towers))
            self.distributed = self.model.engine.place(self.source, skip_batches=skip_batches)
            self.iterator = iter(self.distributed)
            return
        self.source.check_finite(strategy.num_towers)
        self.resumed_skip = None if skip_batches is None else list(skip_batches)
        self.steps_have_data = fills_every_step(self.source, strategy, skip_batches)
        if self.by_pass and (strategy.num_towers == 1 or self.steps_have_data) and strategy.single_process and hasattr(
                self.source, "passes_in_a_row"):
            # The towers take a pass's batches in exactly an epoch's steps
            # (one tower; or N whose every step the pass fills, so batch k
            # of the stream goes to tower k mod N as it would in its own
            # pass): the passes in a row, placed once, spare every epoch a
            # new pipeline and iterator (an epoch of 4 steps cost 1.4x
            # stock Keras's on one tower; 2 towers' epochs of 4 steps took
            # 80 ms, 11 ms in a row), and every step the question whether
            # data is left.
            self.endless = True
            self.iterator = iter(self.model.engine.place(
                self.source.passes_in_a_row(), pass_index=epoch_num - 1, skip_batches=skip_batches))
            return
        if self.by_pass:
            return
        self.distributed = self.model.engine.place(self.source)
        if skip_batches is not None:
            self.resumed_pass = self.model.engine.place(self.source, skip_batches=skip_batches)
        # Epoch e is the input's pass e-1, also in a resumed run: making
        # (and dropping) the iterators of the passes before puts a resumed
        # run at the same order.
        for _ in range(epoch_num - 1):
            iter(self.distributed)

    def begin_pass(self, loop):
        if self.steps_per_epoch:
            return
        skip, self.resumed_skip = self.resumed_skip, None
        loop.tower_batches = skip or [0] * self.model.num_towers
        if self.endless:  # the passes in a row: the iterator goes on
            return
        if self.by_pass:
            self.iterator = iter(self.model.engine.place(
                self.source, pass_index=loop.epoch_num - 1, skip_batches=skip))
        elif skip is not None:
            self.iterator = iter(self.resumed_pass)
        else:
            self.iterator = iter(self.distributed)

    def run(self, num_steps, loop):
        first = loop.global_step + 1
        what = f"Training step {first}" + (f" (or up to {first + num_steps - 1})" if num_steps > 1 else "")
        run = step_calls.run_steps(self.function, self.iterator, num_steps, what,
                                self.endless or self.steps_have_data,
                                failures=self.model.engine.failures,
                                one_step_calls=self.steps_per_call == 1)
        # The failed step's batches were taken, but its update was not applied.
        done = run.steps - (run.nonfinite_towers is not None)
        return StepRun(
            taken=run.steps, done=done, logs=run.logs, final_logs=run.final_logs,
            tower_batches=list(run.tower_batches) if run.steps else [],
            examples=int(run.examples), tower_examples=run.tower_examples,
            nonfinite_towers=run.nonfinite_towers)
