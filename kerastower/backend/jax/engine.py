"""The JAX StepEngine: every step one jitted call over the towers' devices.

Sources are the per-tower batches of kerastower/inputs/jax_sources.py
(numpy arrays, generators, PyDatasets); `step.TowerSteps` holds the jitted
steps over a mesh of the towers' devices (one per number of towers: a
pass's short last step runs on fewer, or joined on one), and the weights
the towers hold between steps, written into the model's variables by
`sync_state` (Keras's `jax_state_sync`).
"""

import contextlib
import dataclasses

import jax
import keras
import numpy as np

from kerastower import _compat
from kerastower.backend import building
from kerastower.inputs import keras_order
from kerastower.backend.engine import Feed
from kerastower.backend.engine import StepEngine
from kerastower.backend.engine import StepRun
from kerastower.backend.jax.tower_function import TowerFunctionRunner
from kerastower.backend.jax import step as jax_step
from kerastower.errors import InputSourceError
from kerastower.inputs import jax_sources

__all__ = ["JaxEngine"]


class JaxEngine(StepEngine):
    """Runs a TowerModel's steps with `jax.jit` over `shard_map` (see StepEngine)."""

    def __init__(self, model):
        super().__init__(model)
        self._steps = {}  # number of towers -> jax_step.TowerSteps

    def compiled(self, jit_compile):
        self._steps = {}

    def tower_steps(self, num_towers=None):
        """The `step.TowerSteps` of the first `num_towers` towers (all by default)."""
        devices = self.model.tower_strategy.step_devices(num_towers or self.model.num_towers)
        if len(devices) not in self._steps:
            mesh = jax_step.tower_mesh(devices)
            self._steps[len(devices)] = jax_step.TowerSteps(
                self.model, mesh, getattr(self.model, "tower_check_finite", True))
        return self._steps[len(devices)]

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
        if validation_split and jax_sources.is_batched(x):
            raise InputSourceError(
                f"validation_split cuts numpy arrays; x is a {type(x).__name__}. Pass "
                "validation_data (arrays, a generator or a PyDataset) instead.")

    def input_source(self, x, y=None, sample_weight=None, batch_size=None, shuffle=False,
                     repeat=False, method="fit", steps=None):
        source = jax_sources.tower_batches(x, y, sample_weight, batch_size, shuffle)
        source.repeated = bool(repeat)
        if method == "fit" and getattr(source, "rows", None) is not None:
            keras_order.follow_keras(source.rows, self.model.tower_strategy)
        if getattr(source, "shuffle_seed", None) is not None:
            source.shuffle_seed = self.model.tower_strategy.agree_on_seed(source.shuffle_seed)
        if not steps:
            source.check_finite(method)
        return source

    def validation_source(self, validation_data, batch_size, steps=None):
        data = tuple(validation_data) if isinstance(validation_data, (tuple, list)) else (validation_data,)
        val_x, val_y, val_weight = data + (None,) * (3 - len(data))
        source = jax_sources.tower_batches(
            val_x, val_y, val_weight, None if jax_sources.is_batched(val_x) else batch_size)
        if not steps:
            source.check_finite("fit", "validation_steps")
        return source

    def build_for(self, source, step=None, with_targets=True):
        """Builds the model, its loss and metrics from the source's first
        batch, read only when something is still unbuilt. Prediction
        builds nothing: Keras's JAX predict step builds what it calls."""
        if not with_targets:
            return
        model = self.model
        building.mark_built_by_parts(model)
        unbuilt = (not all(layer.built for layer in _compat.flatten_layers(model))
                   or _compat.compiled_loss_or_metrics_unbuilt(model))
        _compat.symbolic_build(model, source.first_batch() if unbuilt else None)

    # steps

    def fit_feed(self, source, steps_per_epoch, steps_per_call):
        return _Feed(self, source, steps_per_epoch, steps_per_call)

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

    def memory_peaks(self):
        devices = self.model.tower_strategy.step_devices(self.model.num_towers)
        # Another process's devices (multihost) report to that process only.
        stats = [d.memory_stats() for d in devices if d.process_index == jax.process_index()]
        return [s["peak_bytes_in_use"] for s in stats if s and "peak_bytes_in_use" in s]

    @contextlib.contextmanager
    def running(self, source=None):
        try:
            yield
        finally:
            self.sync_state()  # also when training stopped on an error


def _padded(batch):
    """`(x, y, sample_weight)`, with None for what the batch does not hold."""
    return tuple(batch) + (None,) * (3 - len(batch))


def _shapes(step):
    return [[np.shape(leaf) for leaf in keras.tree.flatten(batch)] for batch in step]


class _Feed(Feed):
    """fit's per-tower batches on JAX, read ahead of the step where reading
    ahead cannot change them (arrays)."""

    def __init__(self, engine, source, steps_per_epoch, steps_per_call):
        self.engine = engine
        self.model = engine.model
        self.source = source
        self.steps_per_epoch = steps_per_epoch
        self.steps_per_call = steps_per_call

    def start(self, skip_batches, epoch_num):
        """Arrays and PyDatasets replay their pass's order from the seed and
        skip what was taken; a generator's batches are read and dropped.
        On JAX every tower counts the steps, so a step's batches are skipped
        whole."""
        self.endless = bool(self.steps_per_epoch)
        self._ahead = self._pending = self._launched = None
        for tower_steps in self.engine.all_tower_steps():
            tower_steps.going = None  # a fit after a non-finite step trains again
        self._launching = True
        skip = max(skip_batches) if skip_batches else 0
        self.resumed_pass = None
        if self.endless:
            self.iterator = iter(self.engine.place(self.source, skip_batches=skip_batches))
        elif skip:
            self.resumed_pass = list(skip_batches)

    def begin_pass(self, loop):
        self.loop = loop
        if self.endless:
            return
        loop.tower_batches = [0] * self.model.num_towers
        self._ahead = self._pending = self._launched = None  # a new pass, a new iterator
        skip = 0
        if self.resumed_pass is not None:
            loop.tower_batches, self.resumed_pass = self.resumed_pass, None
            skip = max(loop.tower_batches)
        self.iterator = iter(self.engine.place(self.source, loop.epoch_num - 1, [skip]))

    def run(self, num_steps, loop):
        """Up to `num_steps` steps (`steps_per_execution`), in as few jitted
        calls as the input allows: one, unless a step of another shape (a
        pass's short last step) must run on its own."""
        self.loop = loop
        num_towers = self.model.num_towers
        run = StepRun(tower_batches=[0] * num_towers)
        while run.done < num_steps:
            steps, logs, finite = self._next_call(num_steps - run.done)
            if not steps:
                break
            run.logs = logs
            run.final_logs = self.engine.tower_steps(len(steps[0])).final_logs
            next_steps = self._next_call_steps(num_steps, run.done + len(steps))
            self._look_ahead(next_steps, len(steps[0]))
            if self.flags_read_late and finite is not None and self._next_call_gated(
                    next_steps, run.done + len(steps) >= num_steps, len(steps[0])):
                # Nothing reads these steps before the next call is made
                # (which they gate) or the epoch ends, so their flags are
                # read then (`FitSteps`): the host never waits for the
                # steps it just launched.
                settled = dataclasses.replace(run)

                def settle():
                    self._count(settled, steps, finite)
                    return settled

                self._count(run, steps, None)
                run.settle = settle
                return run
            if not self._count(run, steps, finite):
                break
        return run

    def _count(self, run, steps, finite):
        """Counts in `run` the steps of one call applied, as `finite` (their
        flags, waited for; None: all) says; False when one was not."""
        failed = jax_step.first_nonfinite_step(finite)  # waits for the steps
        done = len(steps) if failed is None else failed[0]
        # A failed step's batches were taken (the input's position, as on
        # TensorFlow); its update was not applied.
        taken = len(steps) if failed is None else done + 1
        num_towers = self.model.num_towers
        for batches in steps[:taken]:
            examples = [len(keras.tree.flatten(b)[0]) for b in batches]
            run.tower_batches = [n + 1 for n in run.tower_batches]
            run.examples += sum(examples)
            if run.tower_examples is None:
                run.tower_examples = examples * (num_towers // len(examples))
        run.done += done
        run.taken += taken
        if failed is None:
            return True
        run.nonfinite_towers = failed[1]
        self._launched = None  # it followed the failed call: dropped
        return False

    def _next_call_gated(self, next_steps, call_completes, num_towers):
        """Whether the call just launched may leave its flags unread: it
        runs the steps asked for, and either no step of this epoch follows
        (its length is reached, or reading ahead found the pass's end), or
        the next call is known to run on the same towers, which it gates
        (launched ahead, or its batches read ahead)."""
        if not call_completes:
            return False
        if next_steps < 1 or self._launched is not None:
            return True
        ahead = self._ahead
        return ahead is not None and (not ahead[0] or len(ahead[0][0]) == num_towers)

    def _next_call(self, most):
        """(the steps of the next call, their logs, their finite flags): the
        call launched ahead when it still starts from the towers' state,
        else a call launched now, of at most `most` steps."""
        launched, self._launched = self._launched, None
        if launched is not None:
            tower_steps = self.engine.tower_steps(len(launched.steps[0]))
            if launched.generation == tower_steps.generation():
                # Its outputs become the towers' state before its flags are
                # read: a non-finite call's outputs are its inputs.
                return (launched.steps, *tower_steps.commit(launched))
            # A callback set a variable (or the metrics were reset): the
            # launched steps run again from the variables, and no later
            # call is launched ahead in this fit (it would be lost again).
            self._ahead = (launched.steps, launched.placed)
            self._launching = False
        steps, placed = self._ahead or (self._take_steps(most), None)
        self._ahead = None
        if not steps:
            return [], None, None
        tower_steps = self.engine.tower_steps(len(steps[0]))
        # The last call's gate, where it ran on the same towers (a call
        # whose flags were left unread always has its next call there).
        return (steps, *self.engine.run_towers("train", steps, placed, going=tower_steps.going))

    def _look_ahead(self, num_steps, num_towers):
        """While the steps just launched run, the next call's batches are
        read and placed (`_read_ahead`) and, where the towers' steps
        allow (`TowerSteps.launches_ahead`), that call is launched too: the
        host's work between two steps (the loop, the callbacks) then
        overlaps the devices', as with the finite check off."""
        self._ahead = self._read_ahead(num_steps)
        if not self._ahead or not self._ahead[0] or len(self._ahead[0][0]) != num_towers:
            return
        tower_steps = self.engine.tower_steps(num_towers)
        if self._launching and tower_steps.launches_ahead():
            self._launched = tower_steps.launch(*self._ahead, going=tower_steps.going)
            self._ahead = None

    _pending = None  # a step taken from the input that must run in a call of its own
    _launched = None  # the next call's steps, launched ahead (`_look_ahead`)

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
        return steps, self.engine.tower_steps(len(steps[0])).place_steps(steps)
