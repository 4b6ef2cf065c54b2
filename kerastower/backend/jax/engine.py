"""The JAX StepEngine: every step one jitted call over the towers' devices.

Sources are the per-tower batches of backend/jax/inputs.py (numpy
arrays, generators, PyDatasets, as inputs/chooser.py chose them); `step.TowerSteps` holds the jitted
steps over a mesh of the towers' devices (one per number of towers: a
pass's short last step runs on fewer, or joined on one), and the weights
the towers hold between steps, written into the model's variables by
`sync_state` (Keras's `jax_state_sync`). fit's input, opened, is
feed.py's `FitFeed`.
"""

import contextlib

import jax
import keras
import numpy as np

from kerastower import _compat
from kerastower.backend import building
from kerastower.inputs import keras_order
from kerastower.backend.engine import StepEngine
from kerastower.backend.engine import StepRun
from kerastower.backend.jax.tower_function import TowerFunctionRunner
from kerastower.backend.jax import step as jax_step
from kerastower.backend.jax.feed import FitFeed
from kerastower.backend.jax.finite_check import step_checks_finite
from kerastower.backend.jax.inputs import tower_batches
from kerastower.backend.jax.metric_reset import MetricResets
from kerastower.errors import InputSourceError
from kerastower.inputs import preprocessing
from kerastower.inputs import python_sources
from kerastower.inputs import ragged_sparse
from kerastower.inputs.chooser import kind_of

__all__ = ["JaxEngine"]


class JaxEngine(StepEngine):
    """Runs a TowerModel's steps with `jax.jit` over `shard_map` (see StepEngine)."""

    backend = "jax"
    pass_order = keras_order.NumpyPassOrder

    def __init__(self, model):
        super().__init__(model)
        self._steps = {}  # number of towers -> jax_step.TowerSteps
        self.metric_resets = MetricResets()
        self._inference_open = False  # inside an evaluate or predict (`open_inference`)

    def compiled(self, jit_compile):
        self._steps = {}
        self.metric_resets = MetricResets()  # compile makes new metric variables
        # As Keras-JAX: jit_compile=False or run_eagerly=True runs the steps
        # uncompiled, op by op (a layer may then read its values as numbers).
        self._jitted = jit_compile is not False and not getattr(self.model, "run_eagerly", False)

    def tower_steps(self, num_towers=None):
        """The `step.TowerSteps` of the first `num_towers` towers (all by default)."""
        devices = self.model.tower_strategy.step_devices(num_towers or self.model.num_towers)
        if len(devices) not in self._steps:
            mesh = jax_step.tower_mesh(devices)
            self._steps[len(devices)] = jax_step.TowerSteps(
                self.model, mesh, step_checks_finite(self.model),
                shard_optimizer=self.model.tower_strategy.shards_optimizer_state)
            # N towers run in one shard_map, traced either way: jitted.
            self._steps[len(devices)].jitted = getattr(self, "_jitted", True) or len(devices) > 1
        steps = self._steps[len(devices)]
        steps.flags_read_late = self.flags_read_late
        steps.inference_variables_kept(self._inference_open)
        return steps

    # Whether fit's calls come back before their flags are read (set
    # through `FitFeed.flags_read_late` at each epoch's start); the steps
    # then take their state as their own.
    flags_read_late = False

    def all_tower_steps(self):
        """Every `step.TowerSteps` made so far."""
        return list(self._steps.values())

    def run_towers(self, mode, batches, placed=None, going=None):
        """One test or predict step on `batches` (one per tower, or one
        holding a pass's last examples); for "train", the steps `batches`
        (a list of such lists) in one call (`placed`: them on the devices;
        `going`: their gate, `TowerSteps.launch`)."""
        steps = self.tower_steps(len(batches[0]) if mode == "train" else len(batches))
        for other in self._steps.values():
            if other is not steps:
                other.sync()
                other.reset_metrics()  # the model's metrics hold the last step's
        if mode == "train":
            return steps.train_steps(batches, placed, going)
        return getattr(steps, mode)(batches)

    # input

    def check_validation_split(self, x, validation_split):
        if validation_split and kind_of(x) in ("batches", "dataset"):
            raise InputSourceError(
                f"validation_split cuts numpy arrays; x is a {type(x).__name__}. Pass "
                "validation_data (arrays, a generator or a PyDataset) instead.")

    def input_source(self, x, y=None, sample_weight=None, batch_size=None, shuffle=False,
                     repeat=False, method="fit", steps=None):
        x, y, sample_weight, batch_size = preprocessing.preprocessed(
            self.model, x, y, sample_weight, batch_size, repeat=repeat)
        source = tower_batches(x, y, sample_weight, batch_size, shuffle)
        source.repeated = bool(repeat)
        if method == "fit" and getattr(source, "rows", None) is not None:
            keras_order.follow_keras(source.rows, self.model.tower_strategy, self.pass_order)
        if getattr(source, "shuffle_seed", None) is not None:
            source.shuffle_seed = self.model.tower_strategy.agree_on_seed(source.shuffle_seed)
        if not steps:
            source.check_finite(method)
        python_sources.read_by(source, method, steps)  # a PyDataset's hooks depend on the call
        return preprocessing.ready(source) if preprocessing.preprocesses(self.model) else source

    def validation_source(self, validation_data, batch_size, steps=None):
        validation_data = preprocessing.preprocessed_validation(self.model, validation_data, batch_size)
        data = tuple(validation_data) if isinstance(validation_data, (tuple, list)) else (validation_data,)
        val_x, val_y, val_weight = data + (None,) * (3 - len(data))
        source = tower_batches(
            val_x, val_y, val_weight, batch_size if kind_of(val_x) == "arrays" else None)
        if not steps:
            source.check_finite("fit", "validation_steps")
        return preprocessing.ready(source) if preprocessing.preprocesses(self.model) else source

    def build_for(self, source, step=None, with_targets=True):
        """Builds the model, its loss and metrics from the source's first
        batch, read only when something is still unbuilt. Prediction
        builds only a model with layers never built, by calling it on the
        first batch's inputs, as Keras's JAX predict does."""
        model = self.model
        if not with_targets:
            if not all(layer.built for layer in _compat.flatten_layers(model)):
                x, _, _ = keras.utils.unpack_x_y_sample_weight(source.first_batch())
                with keras.StatelessScope():
                    model(x)
            return
        building.mark_built_by_parts(model)
        unbuilt = (not all(layer.built for layer in _compat.flatten_layers(model))
                   or _compat.compiled_loss_or_metrics_unbuilt(model))
        _compat.symbolic_build(model, source.first_batch() if unbuilt else None)

    # steps

    def fit_feed(self, source, steps_per_epoch, steps_per_call):
        return FitFeed(self, source, steps_per_epoch, steps_per_call)

    def place(self, source, pass_index=0, skip_batches=None):
        """Each step's numpy batches, one per tower, of pass `pass_index` (and
        the passes after it, for a source made with `repeat`): the step puts
        them on the towers' devices. Every tower counts the steps, so a
        resumed pass skips the most steps any tower took, whole."""
        skip = max(skip_batches) if skip_batches else 0
        if getattr(source, "repeated", False):
            return source.endless(self.model.num_towers, first_pass=pass_index, skip_steps=skip)
        return source.one_pass(self.model.num_towers, pass_index, skip_steps=skip)

    def test_steps(self, iterator, num_steps, first_step):
        run = StepRun()
        for _ in range(num_steps):
            tower_batches = next(iterator, None)
            if tower_batches is None:
                break
            run.logs = self.run_towers("test", tower_batches)
            run.final_logs = self.tower_steps(len(tower_batches)).final_logs
            run.taken += 1
            run.done += 1
        return run

    def predict_step(self, iterator, step):
        tower_batches = next(iterator, None)
        if tower_batches is None:
            return None
        return self.run_towers("predict", tower_batches)

    def joined_outputs(self, parts):
        # Keras-JAX's predict joins by np.concatenate, which takes no sparse array.
        if any(ragged_sparse.is_sparse(p) for p in parts):
            raise ragged_sparse.sparse_predictions_refused()
        return None

    @contextlib.contextmanager
    def training_metrics_kept(self):
        model = self.model
        variables = [np.asarray(v.value) for v in model.metrics_variables]
        held = [(steps, steps.metric_values()) for steps in self.all_tower_steps()]
        try:
            yield
        finally:
            for variable, value in zip(model.metrics_variables, variables):
                variable.assign(value)
            for steps, values in held:
                steps.restore_metric_values(values)

    def inference_sums(self, source, counters, compiled):
        """Each counter's sums over the source: every step's towers predict
        their own batches (data-parallel, each example once), and the sums
        are taken over the step's examples, in float64 across steps."""
        # An inferencer reads predictions only: the compiled loss and its
        # labels play no part (one-hot labels under a sparse loss included).
        self.build_for(source, with_targets=False)
        totals = None
        for step in self.place(source):
            y_pred = self.run_towers("predict", step)   # the towers' outputs, in tower order
            _, y, sample_weight = (
                None if parts[0] is None else keras.tree.map_structure(lambda *a: np.concatenate(a), *parts)
                for parts in zip(*(_padded(batch) for batch in step)))
            sums = [{k: np.float64(v) for k, v in c._batch_sums(y, y_pred, sample_weight).items()}
                    for c in counters]
            totals = sums if totals is None else [
                {k: total[k] + part[k] for k in total} for total, part in zip(totals, sums)]
        if totals is None:
            raise ValueError("InferenceRunner: the validation source gave no batch.")
        return totals

    # state

    def run_tower_function(self, tower_function, args):
        if tower_function.runner is None:
            tower_function.runner = TowerFunctionRunner(tower_function)
        return tower_function.runner(self.model, args)

    def logs_of_every_tower(self, logs):
        return dict(logs)  # the steps' logs are every process's towers' already

    def sync_state(self):
        self.model.jax_state_sync()

    def wait_for_steps(self):
        optimizer = getattr(self.model, "optimizer", None)
        variables = list(self.model.variables) + list(getattr(optimizer, "variables", None) or [])
        jax.block_until_ready([v.value for v in variables])

    def memory_peaks(self):
        devices = self.model.tower_strategy.step_devices(self.model.num_towers)
        # Another process's devices (multihost) report to that process only.
        stats = [d.memory_stats() for d in devices if d.process_index == jax.process_index()]
        return [s["peak_bytes_in_use"] for s in stats if s and "peak_bytes_in_use" in s]

    def optimizer_state_bytes(self):
        held = self.tower_steps().optimizer_state_bytes()
        return {str(device): size for device, size in held.items()}

    def open_inference(self, source, steps=None):
        # An evaluation or prediction changes no variable list: its steps
        # may walk the model's layers for them once (`tower_steps`).
        self._inference_open = True
        return super().open_inference(source, steps)

    @contextlib.contextmanager
    def running(self, source=None):
        try:
            with python_sources.reading(source):  # a PyDataset's reset, as Keras's
                yield
        finally:
            self._inference_open = False
            for tower_steps in self.all_tower_steps():
                tower_steps.inference_variables_kept(False)
            self.sync_state()  # also when training stopped on an error


def _padded(batch):
    """`(x, y, sample_weight)`, with None for what the batch does not hold."""
    return tuple(batch) + (None,) * (3 - len(batch))
