"""`kt.Trainer.tower_function` on JAX: a data-parallel step in one jitted call.

As fit's step does it (step.py): the towers' batches are one
array sharded over the towers, and in one `jax.jit` every device runs its own
tower's call of the function (`shard_map`, `lax.switch`), under the tower's
`TowerContext`. Keras runs statelessly inside a jit, so the function runs in
a `keras.StatelessScope` that holds every variable of the training run (the
model's and its optimizers'): it reads and assigns variables as eager code
does, and what it assigned is written into the variables when the call
returns.

- `optimizer.apply(gradients, variables)` inside a tower first averages the
  gradients over the towers, each weighted by its share of the step's
  examples, checks them for NaN/Inf and applies them: every tower then holds
  the same new weights, those of one device on the joined batch;
- any other assignment (BatchNormalization's statistics, a counter, a random
  seed's state) follows tower 0, as non-trainable weights do under fit;
- tower i's random seeds are tower 0's moved by i, as in fit: the towers
  draw their own noise.
"""

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.sharding import NamedSharding

from kerastower import loss_reductions
from kerastower._compat import on_jax as jax_compat
from kerastower.backend.jax.towers import all_finite
from kerastower.backend.jax.towers import from_tower_0
from kerastower.backend.jax.towers import mean_over_towers
from kerastower.backend.jax.towers import sum_over_towers
from kerastower.backend.jax.towers import on_every_tower
from kerastower.backend.jax.towers import per_tower
from kerastower.backend.jax.towers import seed_positions
from kerastower.backend.jax.towers import seeded_apart
from kerastower.backend.jax.varying import varying
from kerastower.errors import nonfinite_error
from kerastower.backend.jax.placement import AXIS
from kerastower.backend.jax.placement import BY_TOWER
from kerastower.backend.jax.placement import REPLICATED
from kerastower.backend.jax.placement import place_tower_batches
from kerastower.backend.jax.placement import tower_mesh
from kerastower.backend import engine
from kerastower.errors import KerasTowerError
from kerastower.tower import TowerContext
from kerastower.checkpoint.training_state import training_optimizers
from kerastower.checkpoint.training_state import training_state

__all__ = ["TowerBatches", "TowerFunctionRunner", "traced_state"]

_tracing = threading.local()


class TowerBatches(list):
    """One batch per tower, in tower order: what `Trainer.next_batches()`
    returns on JAX. Passed to a tower function, each tower gets its own."""


def traced_state():
    """The variables of the training run, while a tower function is traced
    (`kt.minimize` writes back what a differentiated step assigned); else None."""
    return getattr(_tracing, "variables", None)


@contextlib.contextmanager
def _tracing_state(variables):
    saved = traced_state()
    _tracing.variables = variables
    try:
        yield
    finally:
        _tracing.variables = saved


def _unique(variables):
    seen, unique = set(), []
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            unique.append(variable)
    return unique


class _Health:
    """A tower's NaN/Inf flags over its optimizer steps: (the reduced
    gradients were finite, this tower's own were)."""

    def __init__(self):
        self.step_finite = jnp.asarray(True)
        self.own_finite = jnp.asarray(True)

    def record(self, step_finite, own_finite):
        self.step_finite = jnp.logical_and(self.step_finite, step_finite)
        self.own_finite = jnp.logical_and(self.own_finite, own_finite)


class TowerFunctionRunner(engine.TowerFunctionRunner):
    """Compiles and runs one tower function on JAX: one jitted call over
    the towers (see the module's docstring)."""

    def __call__(self, model, args):
        strategy = model.tower_strategy
        if not getattr(strategy, "single_process", True):
            raise KerasTowerError(
                f"tower_function {self.__name__!r}: on JAX, kt.Trainer's tower functions run "
                f"on the devices of one process; the strategy is {strategy!r}. Use "
                '"mirrored" (or KERAS_BACKEND=tensorflow with "horovod" or "multiworker").')
        if strategy.shards_optimizer_state and strategy.num_towers > 1:
            raise KerasTowerError(
                f"tower_function {self.__name__!r}: kt.Trainer's tower functions keep the whole "
                f"optimizer state on every tower; {strategy!r} was made with shard_optimizer=True, "
                "which fit's steps have (a TowerModel's fit, compute_loss or train_step). Leave "
                "shard_optimizer off for a kt.Trainer.")
        for optimizer in training_optimizers(model):
            if not optimizer.built:
                raise KerasTowerError(
                    f"tower_function {self.__name__!r}: the optimizer {optimizer.name} is not "
                    "built, and on JAX it cannot make its slots inside the compiled step. "
                    "Build it in the trainer's _setup(): optimizer.build(variables).")
        variables = _unique(training_state(model))
        num_towers = next((len(a) for a in args if isinstance(a, TowerBatches)), model.num_towers)
        mesh = tower_mesh(strategy.step_devices(num_towers))
        kinds = tuple(isinstance(a, TowerBatches) for a in args)
        args = tuple(place_tower_batches(mesh, list(a)) if kind else a for a, kind in zip(args, kinds))
        replicated = NamedSharding(mesh, REPLICATED)
        state = jax.device_put([v.value for v in variables], replicated)
        compiled = self._compiled_for(model, mesh, variables)
        changed, outputs, flags = compiled(state, args, kinds)
        flags = np.asarray(flags)
        if not flags[:, 0].all():
            bad = np.flatnonzero(~flags[:, 1]).tolist() or list(range(num_towers))
            raise nonfinite_error(model.loop.global_step + 1, bad, num_towers)
        for index, value in changed.items():
            variables[index].assign(value)
        if self.reduce is None:
            return {k: list(v) for k, v in outputs.items()}
        return outputs

    def _compiled_for(self, model, mesh, variables):
        if self._compiled is None:
            self._compiled = {}
        key = (tuple(mesh.devices.flat), tuple(id(v) for v in variables))
        if key not in self._compiled:
            self._compiled[key] = jax.jit(
                functools.partial(self._run, model, mesh, variables), static_argnums=2)
        return self._compiled[key]

    # -- inside the jit -----------------------------------------------------

    def _run(self, model, mesh, variables, state, args, kinds):
        num_towers = mesh.size
        changed = set()  # what any tower assigned, found while the towers are traced
        seeds = seed_positions(model, variables)

        def tower(index, state, args):
            return self._tower(model, variables, seeds, changed, index, num_towers, state, args, kinds)

        def body(state, args):
            if num_towers > 1:
                state = per_tower(state, num_towers)
            new_state, outputs, weight, health = on_every_tower(tower, num_towers, state, args)
            changed_indices = sorted(changed)
            new = dict(zip(changed_indices, from_tower_0([new_state[i] for i in changed_indices], num_towers)))
            return new, self._reduced(outputs, weight, num_towers), jnp.stack(health)[None]

        if num_towers == 1:
            return body(state, args)
        in_specs = ([REPLICATED] * len(state), tuple(BY_TOWER if k else REPLICATED for k in kinds))
        out_specs = (REPLICATED, BY_TOWER if self.reduce is None else REPLICATED, BY_TOWER)
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(state, args)

    def _tower(self, model, variables, seeds, changed, index, num_towers, state, args, kinds):
        name = getattr(self, "__qualname__", self.__name__)
        tower_args = tuple(_unwrapped(a) if kind else a for a, kind in zip(args, kinds))
        examples = jax.tree.leaves(tower_args[0])[0].shape[0] if kinds and kinds[0] else None
        if self.reduce == "mean" and args and examples is None:
            raise KerasTowerError(
                f"tower_function {name!r} with reduce=\"mean\" weights each tower's values by "
                "the batch size of its first argument, which is not the towers' batches "
                f"(got {type(args[0]).__name__}). Pass next_batches() first, or use "
                "reduce=\"sum\" or None.")
        weight = jnp.asarray(1.0 if examples is None else examples, "float32")
        values = seeded_apart(state, seeds, num_towers)
        ctx = TowerContext(index, num_towers, self.training)
        ctx.strategy, ctx.num_examples = model.tower_strategy, examples
        ctx.batch_size = examples
        ctx.sum_over_towers = sum_over_towers(num_towers)
        ctx.example_weight = jnp.asarray(1.0 / num_towers, "float32")  # the towers' batches have one shape
        ctx.check_finite = getattr(model, "tower_check_finite", True)
        health = _Health()
        optimizers = training_optimizers(model)
        ctx.held_optimizers = optimizers
        # collect_losses: layers' add_loss (activity regularizers) reach model.losses.
        with ctx, keras.StatelessScope(state_mapping=list(zip(variables, values)),
                                       collect_losses=True) as scope, \
                _tracing_state(variables), _reducing_apply(optimizers, weight, ctx, health):
            initial = dict(scope.state_mapping)
            outputs = self.fn(*tower_args)
        if self.training:
            loss_reductions.warn_if_unseen(model, ctx)
        held = {id(v) for v in variables}
        if any(key not in held for key in scope.state_mapping):
            raise KerasTowerError(
                f"tower_function {name!r} assigned a variable that neither the model nor its "
                "optimizers hold, so its new value would be lost (and on JAX a variable read "
                "there is fixed when the function is compiled). Keep it on the model: "
                "self.add_variable(...) in a trainer's _setup(), or model.add_weight(...).")
        if not isinstance(outputs, dict):
            raise KerasTowerError(
                f"tower_function {name!r} must return a dict of values to reduce over "
                f"towers; got {type(outputs).__name__}.")
        new_state = []
        for i, variable in enumerate(variables):
            value = scope.state_mapping[id(variable)]
            if value is not initial[id(variable)]:
                changed.add(i)
            new_state.append(varying(value, num_towers))
        outputs = {k: varying(jnp.asarray(v), num_towers) for k, v in outputs.items()}
        flags = [varying(health.step_finite, num_towers), varying(health.own_finite, num_towers)]
        return new_state, outputs, weight, flags

    def _reduced(self, outputs, weight, num_towers):
        if self.reduce is None:
            return {k: v[None] for k, v in outputs.items()}
        if num_towers == 1:
            return outputs
        if self.reduce == "sum":
            return {k: jax.lax.psum(v, AXIS) for k, v in outputs.items()}
        total = jax.lax.psum(weight, AXIS)
        return {k: jax.lax.psum(v.astype("float32") * weight, AXIS) / total for k, v in outputs.items()}


def _unwrapped(batch):
    """A tower's batch as the source gave it: `x` rather than `(x,)`."""
    return batch[0] if isinstance(batch, tuple) and len(batch) == 1 else batch


@contextlib.contextmanager
def _reducing_apply(optimizers, weight, ctx, health):
    """Inside a tower, `optimizer.apply` reduces over the towers, then applies."""
    for optimizer in optimizers:
        object.__setattr__(optimizer, "apply", functools.partial(
            _apply_reduced, optimizer, type(optimizer).apply, weight, ctx, health))
    try:
        yield
    finally:
        for optimizer in optimizers:
            object.__delattr__(optimizer, "apply")


def _apply_reduced(optimizer, keras_apply, weight, ctx, health, grads, trainable_variables=None):
    num_towers = ctx.total
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise KerasTowerError(
            f"{optimizer.name} is a LossScaleOptimizer (mixed precision), which a tower function "
            "on JAX cannot apply yet: its update skips steps with a cond that Keras cannot run "
            "inside the compiled step. Use fit, a float32 policy here, or KERAS_BACKEND=tensorflow.")
    if trainable_variables is None:
        raise KerasTowerError(
            f"{optimizer.name}.apply(grads) inside a tower function on JAX: pass the "
            "variables too, apply(grads, variables), so kerastower knows what it updates.")
    grads, trainable_variables = list(grads), list(trainable_variables)
    own_finite = all_finite(grads)
    if num_towers > 1:
        grads = mean_over_towers(grads, weight)
    touched = _unique(list(optimizer.variables) + trainable_variables)

    def applied():
        with jax_compat.inheriting_stateless_scope([]) as scope:
            keras_apply(optimizer, grads, trainable_variables)
        return [varying(scope.state_mapping.get(id(v), v.value), num_towers) for v in touched]

    def skipped():
        return [varying(v.value, num_towers) for v in touched]

    if ctx.check_finite:
        finite = all_finite(grads)
        health.record(finite, own_finite)
        new_values = jax.lax.cond(finite, applied, skipped)
    else:  # compile(check_finite=False)
        new_values = applied()
    for variable, value in zip(touched, new_values):
        variable.assign(value)
