"""The compiled tower step on JAX: one batch per tower per step, one jitted call.

One step of N towers, as backend/tensorflow/step.py does it on TensorFlow:

1. each tower's batch is put on its own device, and the N batches become one
   array sharded over the towers (`place_tower_batches` in placement.py):
   no host-side join;
2. in one `jax.jit`, `shard_map` runs on every device the branch of that
   device's tower (`lax.switch` over the towers): the model's own
   `train_step(state, data)` traced under a TowerContext whose index is a
   Python int, so tower code may branch on it as on TensorFlow;
3. the tower's call of `optimizer.stateless_apply` hands its gradients out
   instead of applying them: they are averaged over the towers (a tower's
   share is n_i / sum_j n_j, and the towers' batches have one shape here,
   so 1/N), checked for NaN/Inf, and the optimizer is applied once, to the
   averaged gradients (where gradients are reduced);
4. non-trainable weights (BatchNormalization statistics, seed states) follow
   tower 0; each tower keeps its own metric variables, summed when the logs
   are read, so the logs are example-weighted over towers.

Synchronized BatchNormalization sums its moments over the towers while a
tower is traced (sync.py); tower i's random seeds are tower 0's moved
by i, so the towers' Dropout masks differ.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.sharding import NamedSharding

from kerastower.backend.jax import towers as jax_towers
from kerastower.backend.jax.towers import first_nonfinite_step
from kerastower.backend.jax.placement import AXIS
from kerastower.backend.jax.placement import BY_TOWER
from kerastower.backend.jax.placement import BY_STEP_AND_TOWER
from kerastower.backend.jax.placement import REPLICATED
from kerastower.backend.jax.placement import local_value
from kerastower.backend.jax.placement import place_tower_batches
from kerastower.backend.jax.placement import spans_processes
from kerastower.backend.jax.placement import tower_mesh
from kerastower.backend.jax.step_values import StepValues
from kerastower.errors import TowerRuleError
from kerastower.tower import TowerContext

__all__ = ["AXIS", "tower_mesh", "place_tower_batches", "spans_processes", "local_value",
           "first_nonfinite_step", "LaunchedSteps", "TowerSteps"]


class _TakenGradients:
    def __init__(self):
        self.gradients = None


@contextlib.contextmanager
def _gradients_taken(optimizer, step_name):
    """Inside a tower, `optimizer.stateless_apply` keeps the gradients and
    changes nothing: the step applies them once, reduced over the towers."""
    taken = _TakenGradients()

    def stateless_apply(optimizer_variables, grads, trainable_variables):
        if taken.gradients is not None:
            raise TowerRuleError(
                f"{step_name} called optimizer.stateless_apply twice in one tower. "
                "kerastower applies one reduced update per step; apply once."
            )
        taken.gradients = list(grads)
        return list(trainable_variables), list(optimizer_variables)

    object.__setattr__(optimizer, "stateless_apply", stateless_apply)
    try:
        yield taken
    finally:
        object.__delattr__(optimizer, "stateless_apply")


# A call launched ahead cannot take the state it starts from as its own
# (donated), so it writes a new one: up to three states live at once (the
# one computed, the one held, the one the variables got at a sync). On
# accelerators that is memory only; above this size a step takes long
# enough that the host's work between steps costs little.
LAUNCH_AHEAD_MAX_BYTES = 1 << 30
# On a CPU each new state is fresh host memory, paid in page faults: on a
# 2-core VM, 0.07 ms per MiB (a 1024-wide MLP's 22 MiB of weights and Adam
# slots took 1.9 ms more a step), against about 0.1 ms of host work that
# launching ahead hides.
LAUNCH_AHEAD_MAX_BYTES_CPU = 1 << 20


class LaunchedSteps:
    """Training steps dispatched and not yet committed (`TowerSteps.launch`).

    Attributes:
        steps: their batches, a list of one per tower for each step.
        placed: those batches on the devices (None: placed by the launch).
        generation: the `TowerSteps.generation` they started from.
        outputs: what the jitted call returns, still being computed.
    """

    def __init__(self, steps, placed, generation, outputs):
        self.steps = steps
        self.placed = placed
        self.generation = generation
        self.outputs = outputs


class TowerSteps:
    """The compiled train, test and predict steps of `model` on `mesh`'s
    towers, and the training state they carry between calls.

    The state lives on the towers' devices between steps and is written
    back into the model's variables after every call, so callbacks and
    checkpoints see the weights of the last step.
    """

    def __init__(self, model, mesh, check_finite=True):
        self.model = model
        self.mesh = mesh
        self.num_towers = mesh.size
        self.check_finite = check_finite
        self.step_values = StepValues(model, "train_step")
        self.test_values = StepValues(model, "test_step")
        self.final_logs = None  # the last step's `StepRun.final_logs`
        self._functions = {}
        self._tower_metrics = None
        self._summed_metrics = None  # their sum over the towers, replicated
        self._metrics_written = None  # the _summed_metrics last written into the model's
        self._held = None
        self._written = None  # what `sync` left in the variables (see _check_written)
        self._generation = 0
        self._launches_ahead = None
        self._stack_metrics = None
        self._spans = spans_processes(mesh)
        self._host_memory = all(d.platform == "cpu" for d in mesh.devices.flat)

    # -- state ------------------------------------------------------------

    def _replicated(self, values):
        sharding = NamedSharding(self.mesh, REPLICATED)
        # Across processes, every process puts its own copy of the same value.
        # One device_put for all: JAX's per-call cost is most of a small
        # model's epoch when paid per variable.
        values = [np.asarray(v) if self._spans else v for v in values]
        if all(getattr(v, "sharding", None) == sharding for v in values):
            # Placed so already (what the steps gave back, written into the
            # variables): device_put would hand back the same buffers, at a
            # cost per call a small model's fit feels. Values placed
            # otherwise are put, or the step would be compiled again for
            # their sharding.
            return list(values)
        return list(jax.device_put(values, [sharding] * len(values))) if values else []

    def _on_mesh_device(self, values):
        """Whether the mesh is one device and every value lives on it."""
        if self.num_towers != 1:
            return False
        device = self.mesh.devices.flat[0]
        return all(isinstance(v, jax.Array) and v.devices() == {device} for v in values)

    def reset_metrics(self):
        """Every tower's metric variables start again from the model's."""
        self._tower_metrics = self._summed_metrics = None
        self._generation += 1

    def metric_values(self):
        """What the towers' metrics hold, for `restore_metric_values`."""
        return self._tower_metrics, self._summed_metrics

    def restore_metric_values(self, values):
        self._tower_metrics, self._summed_metrics = values
        self._generation += 1

    def _metric_state(self):
        if self._tower_metrics is None:
            # Tower 0 holds what the model's metrics hold, the others zeros:
            # their sum is the model's.
            values = [v.value for v in self.model.metrics_variables]
            sharding = NamedSharding(self.mesh, BY_TOWER)
            if self._spans:
                stacked = [np.stack([np.asarray(v)] + [np.zeros(v.shape, v.dtype)] * (self.num_towers - 1))
                           for v in values]
                self._tower_metrics = list(jax.device_put(stacked, [sharding] * len(stacked)))
            else:
                # Stacked on the devices: reading the values back to the
                # host would wait for the step in flight (every epoch).
                if self._stack_metrics is None:
                    towers = self.num_towers
                    self._stack_metrics = jax.jit(lambda values: [
                        jnp.concatenate([v[None], jnp.zeros((towers - 1,) + v.shape, v.dtype)]) for v in values
                    ], out_shardings=sharding)
                # The values may live on another mesh's devices (a short
                # last step's). On one device they are read where they are:
                # a device_put per epoch cost a small model's fit 0.1 ms.
                if not self._on_mesh_device(values):
                    values = self._replicated(values)
                self._tower_metrics = list(self._stack_metrics(values)) if values else []
        return self._tower_metrics

    def _write_back(self, variables, values):
        # Only this process's copies: a sync needs no other process, so a
        # callback of the chief alone may trigger it.
        for variable, value in zip(variables, values):
            variable.assign(local_value(value))

    # The weights stay on the towers' devices from step to step, and reach
    # the model's variables only when something reads them (`sync`, which
    # Keras calls when a callback touches `self.model`): writing every
    # variable back after every step cost more than a small model's step.
    def _variable_lists(self):
        model = self.model
        optimizer = getattr(model, "optimizer", None)  # predict needs no compile()
        return (model.trainable_variables, model.non_trainable_variables,
                [] if optimizer is None else optimizer.variables)

    def _check_written(self):
        """Drops the held state when a variable it was written into (`sync`)
        holds another value now: a callback set it."""
        if self._written is None:
            return
        # By list: a layer frozen since moves variables from one to another.
        now = [[v.value for v in variables] for variables in self._variable_lists()]
        if [len(values) for values in now] != [len(values) for values in self._written] or any(
                a is not b for values, written in zip(now, self._written) for a, b in zip(values, written)):
            self._held = None
            self._generation += 1
        # Checked once per sync: the steps' next commit replaces the state.
        self._written = None

    def _current_state(self):
        """What the towers hold, else the model's variables (not kept: the
        user may set them before the next call)."""
        self._check_written()
        if self._held is not None:
            return self._held
        return tuple(self._replicated([v.value for v in variables])
                     for variables in self._variable_lists())

    def sync(self):
        """Writes what the towers hold into the model's variables. The next
        step reads the variables again if a callback set one since."""
        if self._held is not None and self._written is None:
            lists = self._variable_lists()
            for variables, values in zip(lists, self._held):
                self._write_back(variables, values)
            if self.launches_ahead():
                # The steps do not take the held state as their own, so it
                # may stay theirs while the variables hold it unchanged:
                # an epoch's end then costs the next step no placement.
                self._written = [[v.value for v in variables] for variables in lists]
            else:
                self._held = None
                self._generation += 1
        self._write_metrics()

    def _write_metrics(self):
        # Once per new value: fit syncs at every epoch's end and again at
        # its own, and each assign costs a small model's fit about 10 us.
        if self._summed_metrics is not None and self._summed_metrics is not self._metrics_written:
            self._write_back(self.model.metrics_variables, self._summed_metrics)
            self._metrics_written = self._summed_metrics

    # -- the steps --------------------------------------------------------

    def place(self, batches):
        """Puts one batch per tower on the towers' devices; JAX copies in the
        background, so placing the next step's batches overlaps this one.
        One tower on a CPU takes its numpy batch as it is: the jitted step
        reads host memory there, and a device_put would cost more than the
        copy it hides."""
        if self.num_towers == 1 and self._host_memory:
            return batches[0]
        return place_tower_batches(self.mesh, batches)

    def place_steps(self, steps):
        """Several steps' batches (each a list of one per tower) on the
        towers' devices: each tower's batches of every step joined, in order."""
        if len(steps) == 1:
            return self.place(steps[0])
        joined = [jax.tree.map(lambda *parts: np.concatenate(parts), *[step[i] for step in steps])
                  for i in range(len(steps[0]))]
        return self.place(joined)

    def train_steps(self, steps, placed=None):
        """`len(steps)` training steps in one call (`steps_per_execution`),
        each a list of one batch per tower, all of one shape (`placed`:
        them, already placed). Returns (the last step's logs, each tower's
        finite flag by step, still on the devices: `first_nonfinite_step`
        reads them; None when unchecked)."""
        return self.commit(self.launch(steps, placed))

    def launch(self, steps, placed=None):
        """Dispatches `len(steps)` training steps from the state the towers
        hold and returns them in flight (`LaunchedSteps`), not yet the
        towers' state: `commit` makes them so.

        Where the steps launch ahead (`launches_ahead`), the state they
        start from is not donated to them: it stays the towers' until
        they are committed, so a callback may still read it (a sync) and
        the loop may still drop them (stopping before them). The steps of
        a non-finite call change nothing, so its outputs are its inputs.
        """
        data = self.place_steps(steps) if placed is None else placed
        if len(steps) == 1:
            function = self._function("train", self._train_body)
        else:
            function = self._function(f"train_steps:{len(steps)}",
                                      functools.partial(self._train_steps_body, len(steps)))
        state = (*self._current_state(), self._metric_state())
        if not self.launches_ahead():
            self._held = self._written = None  # donated to the step
        return LaunchedSteps(steps, data, self.generation(), function(state, data))

    def commit(self, launched):
        """Makes the launched steps' outputs the towers' state; returns
        their (logs, flags) as `train_steps` does."""
        (*held, metrics), self._summed_metrics, logs, finite, values = launched.outputs
        self._held, self._tower_metrics = tuple(held), metrics
        self._written = None
        # Steps launched before this commit start from an older state.
        self._generation += 1
        self.final_logs = self.step_values.final_logs(logs)
        logs = self.step_values.logs(logs, values)
        # Unchecked, nothing waits for the steps: the next call is
        # dispatched while they run.
        return logs, (finite if self.check_finite else None)

    def launches_ahead(self):
        """Whether the next call may be launched before this one's finite
        flags are read, and so whether the training steps take the state
        they start from as their own (donated) or not: only where a flag is
        waited for (checked), in one process (a callback's sync that drops
        the launch must not make one process run a call the others do
        not), and where holding the state twice costs less than it hides
        (`LAUNCH_AHEAD_MAX_BYTES`, `LAUNCH_AHEAD_MAX_BYTES_CPU`). Decided
        once, at the first step: one compiled step serves every call."""
        if self._launches_ahead is None:
            size = sum(int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize
                       for variables in self._variable_lists() for v in variables)
            limit = LAUNCH_AHEAD_MAX_BYTES_CPU if self._host_memory else LAUNCH_AHEAD_MAX_BYTES
            self._launches_ahead = self.check_finite and not self._spans and size <= limit
        return self._launches_ahead

    def generation(self):
        """Counts the times the state was replaced: by a commit, or from
        outside the steps (a variable a callback set; metrics reset or
        restored). Steps launched in an older one started from a stale
        state."""
        self._check_written()
        return self._generation

    def test(self, batches):
        """One evaluation step on one batch per tower; returns the logs."""
        model = self.model
        state = (*self._current_state()[:2], self._metric_state())
        function = self._function("test", self._test_body)
        metrics, self._summed_metrics, logs, values = function(state, self.place(batches))
        self._tower_metrics = metrics
        self._write_metrics()
        self.final_logs = self.test_values.final_logs(logs)
        return self.test_values.logs(logs, values)

    def predict(self, batches):
        """The towers' outputs on one batch each, joined in tower order."""
        state = self._current_state()[:2]
        function = self._function("predict", self._predict_body)
        return function(state, self.place(batches))

    def _function(self, mode, body):
        if mode not in self._functions:
            specs = {
                "train": ((REPLICATED,) * 3 + (BY_TOWER, BY_TOWER),
                          (REPLICATED,) * 3 + (BY_TOWER, BY_TOWER, REPLICATED)),
                "train_steps": ((REPLICATED,) * 3 + (BY_TOWER, BY_TOWER),
                                (REPLICATED,) * 3 + (BY_TOWER, BY_STEP_AND_TOWER, REPLICATED)),
                "test": ((REPLICATED,) * 2 + (BY_TOWER, BY_TOWER), (BY_TOWER, REPLICATED)),
                "predict": ((REPLICATED,) * 2 + (BY_TOWER,), BY_TOWER),
            }[mode.split(":")[0]]
            sharded = (body if self.num_towers == 1 else
                       jax.shard_map(body, mesh=self.mesh, in_specs=specs[0], out_specs=specs[1]))
            donated = mode.startswith("train") and not self.launches_ahead()
            self._functions[mode] = jax.jit(
                functools.partial(self._run, mode, sharded), donate_argnums=0 if donated else ())
        return self._functions[mode]

    def _run(self, mode, sharded, state, data):
        if mode == "predict":
            outputs = sharded(*state, data)
            # Every process returns every tower's outputs, in tower order.
            return self._on_every_tower(outputs) if self._spans else outputs
        if mode == "test":
            metrics, values = sharded(*state, data)
            return (metrics, *self._logs(metrics), values)
        *new_state, finite, values = sharded(*state, data)
        return (tuple(new_state), *self._logs(new_state[3]), self._on_every_tower(finite), values)

    def _on_every_tower(self, values):
        """`values`, gathered so that every device (every process) holds all."""
        replicated = NamedSharding(self.mesh, REPLICATED)
        return jax.tree.map(lambda v: jax.lax.with_sharding_constraint(v, replicated), values)

    def _logs(self, tower_metrics):
        """(every tower's metric variables summed, the model's metrics from
        those sums): totals and counts, so example-weighted over towers."""
        summed = self._on_every_tower([m.sum(axis=0) for m in tower_metrics])
        with keras.StatelessScope(state_mapping=list(zip(self.model.metrics_variables, summed))):
            return summed, self._on_every_tower(self.model.get_metrics_result())

    def _switch(self, branch, *args):
        """`branch(index, *args)` for this device's tower (towers.py)."""
        return jax_towers.on_every_tower(branch, self.num_towers, *args)

    def _tower_context(self, index, is_training, examples=None, batch_size=None):
        ctx = TowerContext(index, self.num_towers, is_training)
        ctx.strategy = getattr(self.model, "tower_strategy", None)
        ctx.num_examples = examples
        ctx.batch_size = examples if batch_size is None else batch_size
        ctx.sum_over_towers = jax_towers.sum_over_towers(self.num_towers)
        ctx.example_weight = jnp.asarray(1.0 / self.num_towers, "float32")
        ctx.check_finite = self.check_finite
        return ctx

    def _train_body(self, trainable, non_trainable, optimizer_vars, tower_metrics, data):
        *state, flags, _, values = self._train_step(
            trainable, non_trainable, optimizer_vars, tower_metrics, data)
        return (*state, flags, values)

    def _train_steps_body(self, num_steps, trainable, non_trainable, optimizer_vars, tower_metrics, data):
        """`num_steps` training steps in one `lax.scan`: this tower's batches
        of every step arrive joined (`place_steps`). After a step whose
        gradients were not finite, the later ones change nothing (the loop
        stops at that step, as with one step a call)."""
        steps = jax.tree.map(lambda a: a.reshape((num_steps, a.shape[0] // num_steps) + a.shape[1:]), data)

        def step(carry, batch):
            *state, going = carry
            *new, flags, finite, values = self._train_step(*state, batch, going)
            return (*new, finite if self.check_finite else going), (flags, values)

        carry = (list(trainable), list(non_trainable), list(optimizer_vars), list(tower_metrics),
                 jnp.asarray(True))
        (*state, _), (flags, values) = jax.lax.scan(step, carry, steps, unroll=True)
        return (*state, flags, values[-1])   # the logs show the last step's values

    def _train_step(self, trainable, non_trainable, optimizer_vars, tower_metrics, data, going=True):
        """One step: (the new state, this tower's finite flag, whether the
        step applied its update)."""
        model = self.model
        old_non_trainable = list(non_trainable)
        step_name = f"{type(model).__name__}.train_step"
        positions = jax_towers.seed_positions(model, model.non_trainable_variables)

        def tower(index, trainable, non_trainable, optimizer_vars, metrics, data):
            examples = jax.tree.leaves(data)[0].shape[0]
            non_trainable = jax_towers.seeded_apart(non_trainable, positions, self.num_towers)
            with self._tower_context(index, True, examples), \
                    _gradients_taken(model.optimizer, step_name) as taken:
                logs, (_, non_trainable, _, metrics) = model.train_step(
                    (trainable, non_trainable, optimizer_vars, metrics), data)
            values = self.step_values.local(logs, examples, metrics)
            if taken.gradients is None:
                raise TowerRuleError(
                    f"{step_name} did not call self.optimizer.stateless_apply, so "
                    "there is no update to reduce over the towers. Call it once "
                    "with the gradients, as keras.Model.train_step does on JAX."
                )
            return taken.gradients, list(non_trainable), list(metrics), values

        metrics = [m[0] for m in tower_metrics]
        # Each tower differentiates its own copy of the weights: the gradient
        # of replicated weights would come out summed over the towers.
        gradients, non_trainable, metrics, values = self._switch(
            tower, jax_towers.per_tower(trainable, self.num_towers), non_trainable, optimizer_vars, metrics, data)
        values = self.step_values.reduced(values, self.num_towers > 1)
        if self.num_towers > 1:
            tower_finite = jax_towers.all_finite(gradients)
            gradients = jax_towers.mean_over_towers(gradients)

        def apply():
            return tuple(map(list, model.optimizer.stateless_apply(
                optimizer_vars, gradients, trainable)))

        if self.check_finite:
            finite = jnp.logical_and(jax_towers.all_finite(gradients), going)
            # A cond, not a select of the new values: a skipped update costs
            # nothing and an applied one no extra pass over the weights.
            new_trainable, new_optimizer = jax.lax.cond(
                finite, apply, lambda: (list(trainable), list(optimizer_vars)))
            flags = finite if self.num_towers == 1 else self._towers_to_blame(tower_finite, finite)
        else:
            new_trainable, new_optimizer = apply()
            finite = flags = jnp.asarray(True)
        non_trainable = jax_towers.from_tower_0(non_trainable, self.num_towers)
        metrics = [m[None] for m in metrics]
        if self.check_finite:
            # A step that is not finite changes nothing: no NaN statistics
            # (BatchNormalization's) reach the variables or a checkpoint.
            non_trainable = [jnp.where(finite, n, o) for n, o in zip(non_trainable, old_non_trainable)]
            metrics = [jnp.where(finite, n, o) for n, o in zip(metrics, tower_metrics)]
        return list(new_trainable), non_trainable, list(new_optimizer), metrics, flags[None], finite, values

    def _towers_to_blame(self, tower_finite, finite):
        """Each tower's flag: its own gradients' finiteness; every tower's
        when only their mean overflowed."""
        any_bad = jax.lax.psum(jnp.logical_not(tower_finite).astype(jnp.int32), AXIS) > 0
        return jnp.logical_and(tower_finite, jnp.logical_or(finite, any_bad))

    def _test_body(self, trainable, non_trainable, tower_metrics, data):
        model = self.model

        def tower(index, trainable, non_trainable, metrics, data):
            examples = jax.tree.leaves(data)[0].shape[0]
            with self._tower_context(index, False, batch_size=examples):
                logs, (_, _, metrics) = model.test_step((trainable, non_trainable, metrics), data)
            return list(metrics), self.test_values.local(logs, examples, metrics)

        metrics, values = self._switch(tower, trainable, non_trainable, [m[0] for m in tower_metrics], data)
        return [m[None] for m in metrics], self.test_values.reduced(values, self.num_towers > 1)

    def _predict_body(self, trainable, non_trainable, data):
        model = self.model

        def tower(index, trainable, non_trainable, data):
            ctx = self._tower_context(index, False)
            ctx.name = f"predict_tower{index}"
            with ctx:
                outputs, _ = model.predict_step((trainable, non_trainable), data)
            return outputs

        return self._switch(tower, trainable, non_trainable, data)
