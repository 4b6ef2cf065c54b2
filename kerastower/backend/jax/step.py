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
   so 1/N), checked for NaN/Inf (one tower's from the products that made
   them: finite_check.py), and the optimizer is applied once, to the
   averaged gradients (where gradients are reduced); with
   `shard_optimizer=True`, reduce-scattered instead, each tower updating
   its piece of the weights and gathering the whole
   (`OptimizerShards.update`, optimizer_shards.py);
4. non-trainable weights (BatchNormalization statistics, seed states) follow
   tower 0; each tower keeps its own metric variables, summed when the logs
   are read, so the logs are example-weighted over towers.

Synchronized BatchNormalization sums its moments over the towers while a
tower is traced (sync.py); tower i's random seeds are tower 0's moved
by i, so the towers' Dropout masks differ.

What the towers hold between calls, and when the model's variables get it,
is tower_state.py's `TowerState`, which `TowerSteps` extends with the steps.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.sharding import NamedSharding

from kerastower import _compat
from kerastower import loss_divisors
from kerastower import loss_reductions
from kerastower.backend.jax import finite_check
from kerastower.backend.jax import optimizer_apply
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
from kerastower.backend.jax.tower_state import TowerState
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


class TowerSteps(TowerState):
    """The compiled train, test and predict steps of `model` on `mesh`'s
    towers (the training state they carry between calls: `TowerState`).

    The state lives on the towers' devices between steps and reaches the
    model's variables when something reads them, so callbacks and
    checkpoints see the weights of the last step.
    """

    def __init__(self, model, mesh, check_finite=True, shard_optimizer=False):
        super().__init__(model, mesh, check_finite, shard_optimizer)
        self.step_values = StepValues(model, "train_step")
        self.test_values = StepValues(model, "test_step")
        self.final_logs = None  # the last step's `StepRun.final_logs`
        self.going = None  # whether every step of the last call was finite, on the devices
        self._functions = {}
        self.jitted = True  # False: the steps run op by op (compile's jit_compile=False)
        self._changed_by = {}  # mode -> the non-trainable positions its step changes (`_changed`)
        self._true = None

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

    def train_steps(self, steps, placed=None, going=None):
        """`len(steps)` training steps in one call (`steps_per_execution`),
        each a list of one batch per tower, all of one shape (`placed`:
        them, already placed). Returns (the last step's logs, each tower's
        finite flag by step, still on the devices: `first_nonfinite_step`
        reads them; None when unchecked)."""
        return self.commit(self.launch(steps, placed, going))

    def launch(self, steps, placed=None, going=None):
        """Dispatches `len(steps)` training steps from the state the towers
        hold and returns them in flight (`LaunchedSteps`), not yet the
        towers' state: `commit` makes them so.

        Where the steps launch ahead (`launches_ahead`), the state they
        start from is not donated to them: it stays the towers' until
        they are committed, so a callback may still read it (a sync) and
        the loop may still drop them (stopping before them). The steps of
        a non-finite call change nothing, so its outputs are its inputs.

        `going` (None: True) gates the steps: a boolean on the devices, the
        `going` of a call before (`commit`) whose flags may not have been
        read yet. When it is False, that call was not finite, and these
        steps change nothing either.
        """
        data = self.place_steps(steps) if placed is None else placed
        if len(steps) == 1:
            function = self._function("train", self._train_body)
        else:
            function = self._function(f"train_steps:{len(steps)}",
                                      functools.partial(self._train_steps_body, len(steps)))
        state = (*self._current_state(), self._metric_state())
        self._inference = None  # training changes what it placed
        donated = not self.launches_ahead()
        try:
            outputs = function(state, data, self._gate(going))
        except BaseException:
            # Tracing or compiling failed (or was interrupted) before the
            # call took the state: the towers keep it, unless it was taken.
            if donated and self._held is not None and any(
                    value.is_deleted() for value in jax.tree.leaves(self._held)):
                self._held = self._written = None
            raise
        if donated:
            self._held = self._written = None  # the step took it
        return LaunchedSteps(steps, data, self.generation(), outputs)

    def _gate(self, going):
        if going is not None:
            return going
        if self._true is None:
            self._true = jax.device_put(np.asarray(True), NamedSharding(self.mesh, REPLICATED))
        return self._true

    def commit(self, launched):
        """Makes the launched steps' outputs the towers' state; returns
        their (logs, flags) as `train_steps` does."""
        (*held, metrics), self._summed_metrics, logs, finite, values, self.going = launched.outputs
        self._held, self._tower_metrics = tuple(held), metrics
        self._written = None
        # Steps launched before this commit start from an older state.
        self._generation += 1
        self.final_logs = self.step_values.final_logs(logs)
        logs = self.step_values.logs(logs, values)
        # Unchecked, nothing waits for the steps: the next call is
        # dispatched while they run.
        return logs, (finite if self.check_finite else None)

    def test(self, batches):
        """One evaluation step on one batch per tower; returns the logs."""
        state = (*self._inference_state(), self._metric_state())
        function = self._function("test", self._test_body)
        metrics, self._summed_metrics, logs, values, changed = function(state, self.place(batches))
        self.keep_inference_changes(self._changed_by["test"], changed)
        # The model's metric variables get the sums when something reads
        # them (`sync`: a callback touching `self.model`, evaluate's end).
        self._tower_metrics = metrics
        self.final_logs = self.test_values.final_logs(logs)
        return self.test_values.logs(logs, values)

    def predict(self, batches):
        """The towers' outputs on one batch each, joined in tower order."""
        state = self._inference_state()
        function = self._function("predict", self._predict_body)
        outputs, changed = function(state, self.place(batches))
        self.keep_inference_changes(self._changed_by["predict"], changed)
        return outputs

    def _function(self, mode, body):
        donated = mode.startswith("train") and not self.launches_ahead()
        key = (mode, donated)
        if key not in self._functions:
            shards = self.optimizer_shards() if mode.startswith("train") else None
            # The optimizer's state: whole on every tower, or each slot cut over them.
            optimizer = REPLICATED if shards is None else list(shards.specs)
            specs = {
                "train": ((REPLICATED, REPLICATED, optimizer, BY_TOWER, BY_TOWER, REPLICATED),
                          (REPLICATED, REPLICATED, optimizer, BY_TOWER, BY_TOWER, REPLICATED)),
                "train_steps": ((REPLICATED, REPLICATED, optimizer, BY_TOWER, BY_TOWER, REPLICATED),
                                (REPLICATED, REPLICATED, optimizer, BY_TOWER, BY_STEP_AND_TOWER, REPLICATED)),
                "test": ((REPLICATED,) * 2 + (BY_TOWER, BY_TOWER), (BY_TOWER, REPLICATED, REPLICATED)),
                "predict": ((REPLICATED,) * 2 + (BY_TOWER,), (BY_TOWER, REPLICATED)),
            }[mode.split(":")[0]]
            if mode.startswith("train"):
                body = functools.partial(body, in_place=donated)
            sharded = (body if self.num_towers == 1 else
                       jax.shard_map(body, mesh=self.mesh, in_specs=specs[0], out_specs=specs[1]))
            run = functools.partial(self._run, mode, sharded)
            self._functions[key] = (jax.jit(run, donate_argnums=0 if donated else ())
                                    if self.jitted else run)
        return self._functions[key]

    def _run(self, mode, sharded, state, data, going=None):
        if mode == "predict":
            outputs, changed = sharded(*state, data)
            # Every process returns every tower's outputs, in tower order.
            return (self._on_every_tower(outputs) if self._spans else outputs), changed
        if mode == "test":
            metrics, values, changed = sharded(*state, data)
            return (metrics, *self._logs(metrics), values, changed)
        *new_state, finite, values = sharded(*state, data, going)
        finite = self._on_every_tower(finite)
        # The next call's gate: after a step that was not finite, every
        # flag of the later steps is False too.
        going = jax.lax.with_sharding_constraint(jnp.all(finite), NamedSharding(self.mesh, REPLICATED))
        return (tuple(new_state), *self._logs(new_state[3]), finite, values, going)

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

    def _train_body(self, trainable, non_trainable, optimizer_vars, tower_metrics, data, going, in_place=True):
        *state, flags, _, values = self._train_step(
            trainable, non_trainable, optimizer_vars, tower_metrics, data, going, in_place)
        return (*state, flags, values)

    def _train_steps_body(self, num_steps, trainable, non_trainable, optimizer_vars, tower_metrics, data,
                          going, in_place=True):
        """`num_steps` training steps in one `lax.scan`: this tower's batches
        of every step arrive joined (`place_steps`). After a step whose
        gradients were not finite, the later ones change nothing (the loop
        stops at that step, as with one step a call)."""
        steps = jax.tree.map(lambda a: a.reshape((num_steps, a.shape[0] // num_steps) + a.shape[1:]), data)

        def step(carry, batch):
            *state, going = carry
            *new, flags, finite, values = self._train_step(*state, batch, going, in_place)
            return (*new, finite if self.check_finite else going), (flags, values)

        carry = (list(trainable), list(non_trainable), list(optimizer_vars), list(tower_metrics), going)
        (*state, _), (flags, values) = jax.lax.scan(step, carry, steps, unroll=True)
        return (*state, flags, values[-1])   # the logs show the last step's values

    def _train_step(self, trainable, non_trainable, optimizer_vars, tower_metrics, data, going=True,
                    in_place=True):
        """One step: (the new state, this tower's finite flag, whether the
        step applied its update). `in_place`: whether the call takes the
        state it starts from as its own (donated), else it writes a new one
        (launched ahead, `launches_ahead`)."""
        model = self.model
        old_non_trainable = list(non_trainable)
        step_name = f"{type(model).__name__}.train_step"
        positions = jax_towers.seed_positions(model, model.non_trainable_variables)

        def tower(index, trainable, non_trainable, optimizer_vars, metrics, data):
            examples = jax.tree.leaves(data)[0].shape[0]
            non_trainable = jax_towers.seeded_apart(non_trainable, positions, self.num_towers)
            with self._tower_context(index, True, examples) as ctx, \
                    _gradients_taken(model.optimizer, step_name) as taken:
                logs, (_, non_trainable, _, metrics) = model.train_step(
                    (trainable, non_trainable, optimizer_vars, metrics), data)
            loss_reductions.warn_if_unseen(model, ctx)
            values = self.step_values.local(logs, examples, metrics)
            if taken.gradients is None:
                raise TowerRuleError(
                    f"{step_name} did not call self.optimizer.stateless_apply, so "
                    "there is no update to reduce over the towers. Call it once "
                    "with the gradients, as keras.Model.train_step does on JAX."
                )
            count = loss_divisors.step_loss_count(
                ctx, warn=bool(_compat.accumulation_steps(model.optimizer)))
            return taken.gradients, list(non_trainable), list(metrics), values, count

        metrics = [m[0] for m in tower_metrics]
        shards = self.optimizer_shards()
        tower_args = (jax_towers.per_tower(trainable, self.num_towers), non_trainable,
                      optimizer_vars if shards is None else shards.tower_view(optimizer_vars), metrics, data)
        if self.check_finite and self.num_towers == 1 and self.jitted:
            # One tower's gradients are checked from the products that made
            # them, where that bounds them, and on a CPU those products are
            # computed where the update uses them (finite_check.py). On an
            # accelerator XLA might fuse and tune a product moved into a
            # cond otherwise than the same product with the check off.
            checked, non_trainable, metrics, values, count = self._switch(
                lambda index, *args: finite_check.checked_gradients(
                    functools.partial(tower, index), *args, defer_products=self._host_memory),
                *tower_args)
        else:
            # Each tower differentiates its own copy of the weights: the
            # gradient of replicated weights would come out summed over the
            # towers.
            gradients, non_trainable, metrics, values, count = self._switch(tower, *tower_args)
        values = self.step_values.reduced(values, self.num_towers > 1)
        if shards is not None:
            tower_finite = jax_towers.all_finite(gradients)
            new_trainable, new_optimizer, finite = shards.update(
                gradients, trainable, optimizer_vars, going, self.check_finite)
            flags = self._towers_to_blame(tower_finite, finite) if self.check_finite else jnp.asarray(True)
            return self._step_outputs(new_trainable, non_trainable, old_non_trainable, new_optimizer,
                                      metrics, tower_metrics, flags, finite, values)
        if self.num_towers > 1:
            tower_finite = jax_towers.all_finite(gradients)
            gradients = jax_towers.mean_over_towers(gradients)
            if self.check_finite:
                checked = finite_check.CheckedGradients.of(gradients)
        elif self.check_finite and not self.jitted:
            checked = finite_check.CheckedGradients.of(gradients)

        logged = None
        if count is not None and _compat.accumulation_steps(model.optimizer):
            # The same on every tower, but out of each tower's branch.
            count = jax_towers.from_tower_0([count], self.num_towers)[0]
            metrics, logged = optimizer_apply.cycle_logged(
                model, optimizer_vars, [m[0] for m in tower_metrics], metrics, count, self.num_towers)

        def apply(gradients):
            return optimizer_apply.applied(model.optimizer, optimizer_vars, gradients, trainable, count)

        def keep():
            return list(trainable), list(optimizer_vars)

        if self.check_finite:
            if in_place:
                # A cond, not a select of the new values: a skipped update
                # costs nothing and an applied one no extra pass over the
                # weights.
                (new_trainable, new_optimizer), finite = checked.apply_if_finite(apply, keep, going)
            else:
                # Writing a new state, a cond copies the old one into its
                # operands and out of its untaken branch; a select writes
                # each new value once (a ConvNet's step on a CPU: 0.92 of
                # the donated step with the cond, level with the select).
                finite = checked.finite(going)
                gradients = checked.values()
                new_trainable, new_optimizer = (
                    [jnp.where(finite, n, o) for n, o in zip(new, old)]
                    for new, old in zip(apply(gradients), (trainable, optimizer_vars)))
            flags = finite if self.num_towers == 1 else self._towers_to_blame(tower_finite, finite)
        else:
            # A cond even unchecked (on `going`, True there): its operands
            # order the update after every read of the weights, and it
            # bounds XLA's fusions. Applied outright, a weight the backward
            # pass still reads is copied first (stock Keras-JAX copies a
            # 1024-wide MLP's two inner kernels each step), and in
            # `steps_per_execution`'s unrolled steps XLA:CPU fused SGD with
            # momentum into chains computing each step's weights again from
            # every earlier step's gradients (0.64 of stock Keras-JAX's
            # speed at 8 steps a call; 0.91-0.99 with the cond). An
            # optimization barrier instead of the cond did not keep the
            # copy away: XLA:CPU drops it before placing its buffers.
            new_trainable, new_optimizer = jax.lax.cond(going, lambda: apply(gradients), keep)
            finite = flags = jnp.asarray(True)
        new_optimizer = optimizer_apply.with_cycle_logged(model.optimizer, new_optimizer, logged)
        return self._step_outputs(new_trainable, non_trainable, old_non_trainable, new_optimizer,
                                  metrics, tower_metrics, flags, finite, values)

    def _step_outputs(self, new_trainable, non_trainable, old_non_trainable, new_optimizer, metrics,
                      tower_metrics, flags, finite, values):
        """A step's new state and flags (`_train_step`'s result), the
        non-trainable values tower 0's."""
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
        positions = jax_towers.seed_positions(model, model.non_trainable_variables)

        def tower(index, trainable, non_trainable, metrics, data):
            examples = jax.tree.leaves(data)[0].shape[0]
            non_trainable = jax_towers.seeded_apart(non_trainable, positions, self.num_towers)
            with self._tower_context(index, False, batch_size=examples):
                logs, (_, new_non_trainable, metrics) = model.test_step((trainable, non_trainable, metrics), data)
            changed = self._changed("test", non_trainable, new_non_trainable)
            return list(metrics), self.test_values.local(logs, examples, metrics), changed

        metrics, values, changed = self._switch(
            tower, trainable, non_trainable, [m[0] for m in tower_metrics], data)
        return ([m[None] for m in metrics], self.test_values.reduced(values, self.num_towers > 1),
                jax_towers.from_tower_0(changed, self.num_towers))

    def _predict_body(self, trainable, non_trainable, data):
        model = self.model
        positions = jax_towers.seed_positions(model, model.non_trainable_variables)

        def tower(index, trainable, non_trainable, data):
            ctx = self._tower_context(index, False)
            ctx.name = f"predict_tower{index}"
            non_trainable = jax_towers.seeded_apart(non_trainable, positions, self.num_towers)
            with ctx:
                outputs, new_non_trainable = model.predict_step((trainable, non_trainable), data)
            return outputs, self._changed("predict", non_trainable, new_non_trainable)

        outputs, changed = self._switch(tower, trainable, non_trainable, data)
        return outputs, jax_towers.from_tower_0(changed, self.num_towers)

    def _changed(self, mode, old, new):
        """The non-trainable values an evaluation or prediction step changed
        (a SeedGenerator's state: Dropout at inference), as stock Keras
        carries them on to the next step; which ones is known when the
        step is traced (`_changed_by`), by the values' identity."""
        positions = [i for i, (a, b) in enumerate(zip(old, new)) if a is not b]
        self._changed_by[mode] = positions
        return [new[i] for i in positions]
