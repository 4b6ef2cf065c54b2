"""The TensorFlow StepEngine: steps as `tf.function`s over `strategy.run`.

Sources are InputSources (kerastower/inputs/sources.py), turned into
per-tower iterators by `InputSource.distribute`; a step function
(step.py) pulls one batch per tower per step and runs the model's tower
step on it under its TowerContext.
"""

import numpy as np
import tensorflow as tf

from kerastower.backend.engine import Feed
from kerastower.backend.engine import StepEngine
from kerastower.backend.engine import StepRun
from kerastower.backend.tensorflow import batch_checks
from kerastower.backend.tensorflow.tower_function import TowerFunctionRunner
from kerastower.backend.tensorflow import step as tf_step
from kerastower.backend.tensorflow import step_errors
from kerastower.backend.tensorflow import xla
from kerastower import arguments
from kerastower.inputs.sources import as_input_source

__all__ = ["TensorFlowEngine"]


class StepCache:
    """What the step functions remember between traces."""

    def __init__(self):
        self.local_weights = None
        self.last_gradients = None
        self.collectives = {}
        self.read_logs = None


class TensorFlowEngine(StepEngine):
    """Runs a TowerModel's steps with `tf.distribute` (see StepEngine)."""

    def __init__(self, model):
        super().__init__(model)
        # Lists of variables set as model attributes would be tracked by Keras
        # as the model's own variables (reordering model.variables); the
        # engine, no Keras object, keeps these caches out of its sight.
        self.cache = StepCache()

    def keras_jit_compile(self, jit_compile):
        # Keras's step functions (they would jit the cross-tower work) are unused.
        return False

    def compiled(self, jit_compile):
        self.model.tower_jit_compile = xla.resolve(self.model, jit_compile)
        self.cache.read_logs = None  # it read the metrics compile replaced

    def input_source(self, x, y=None, sample_weight=None, batch_size=None, shuffle=False,
                     repeat=False, method="fit", steps=None):
        if method == "fit":
            return as_input_source(x, y, sample_weight, batch_size, shuffle, repeat=repeat)
        if method == "predict":
            return as_input_source(x, batch_size=batch_size)
        return as_input_source(x, y, sample_weight, batch_size)

    def validation_source(self, validation_data, batch_size, steps=None):
        return arguments.validation_source(validation_data, batch_size)

    def build_for(self, source, step=None, with_targets=True):
        batch_checks.build_for(self.model, source, with_targets, step)

    def fit_feed(self, source, steps_per_epoch, steps_per_call):
        return _Feed(self.model, source, steps_per_epoch)

    def open_inference(self, source):
        return iter(source.distribute(self.model.tower_strategy))

    def test_steps(self, iterator, num_steps, first_step):
        run = tf_step.run_steps(self.model.make_test_function(), iterator, num_steps,
                                f"Evaluation step {first_step + 1}")
        return StepRun(taken=run.steps, done=run.steps, logs=run.logs)

    def predict_step(self, iterator, step):
        has_data, next_batches = self.model.tower_strategy.next_step(iterator)
        if not bool(has_data):  # no tower has data left
            return None
        try:
            return self.model.make_predict_function()(next_batches())
        except tf.errors.OpError as error:
            failure = step_errors.explain(error, f"Prediction step {step + 1}")
            raise failure from failure.__cause__

    def run_tower_function(self, tower_function, args):
        if tower_function.runner is None:
            tower_function.runner = TowerFunctionRunner(tower_function)
        return tower_function.runner(self.model, args)

    def logs_of_every_tower(self, logs):
        if logs and not self.model.tower_strategy.single_process:
            # The steps gave this process's metrics; the result is all towers'.
            return dict(tf_step.logs_across_towers(self.model))
        return dict(logs)

    def running(self):
        return batch_checks.original_errors()


class _Feed(Feed):
    """fit's per-tower iterators over an InputSource."""

    def __init__(self, model, source, steps_per_epoch):
        self.model = model
        self.source = source
        self.steps_per_epoch = steps_per_epoch
        self.function = model.make_train_function()
        self.endless = False

    def start(self, skip_batches, epoch_num):
        strategy = self.model.tower_strategy
        if self.steps_per_epoch:
            # Every process must agree, or one would wait in a collective
            # the others skip.
            self.endless = strategy.all_agree(self.source.endless(strategy.num_towers))
            self.distributed = self.source.distribute(strategy, skip_batches=skip_batches)
            self.iterator = iter(self.distributed)
            return
        self.source.check_finite(strategy.num_towers)
        self.distributed = self.source.distribute(strategy)
        self.resumed_pass = None
        if skip_batches is not None:
            self.resumed_pass = (self.source.distribute(strategy, skip_batches=skip_batches),
                                 list(skip_batches))
        # Epoch e is the input's pass e-1, also in a resumed run: a pipeline
        # that reshuffles every pass draws each pass's order when its
        # iterator is made, so making (and dropping) those of the passes
        # before puts a resumed run at the same order.
        for _ in range(epoch_num - 1):
            iter(self.distributed)

    def begin_pass(self, loop):
        if self.steps_per_epoch:
            return
        loop.tower_batches = [0] * self.model.num_towers
        if self.resumed_pass is not None:
            distributed, loop.tower_batches = self.resumed_pass
            self.resumed_pass = None
            self.iterator = iter(distributed)
        else:
            self.iterator = iter(self.distributed)

    def run(self, num_steps, loop):
        first = loop.global_step + 1
        what = f"Training step {first}" + (f" (or up to {first + num_steps - 1})" if num_steps > 1 else "")
        run = tf_step.run_steps(self.function, self.iterator, num_steps, what, self.endless)
        # The failed step's batches were taken, but its update was not applied.
        done = run.steps - (run.nonfinite_towers is not None)
        return StepRun(
            taken=run.steps, done=done, logs=run.logs,
            tower_batches=np.asarray(run.tower_batches, np.int64).tolist() if run.steps else [],
            examples=int(run.examples), tower_examples=run.tower_examples,
            nonfinite_towers=run.nonfinite_towers)
