"""`kt.minimize` on JAX: one optimizer step on a loss, by `jax.value_and_grad`."""

import jax

from kerastower._compat import on_jax as jax_compat
from kerastower.backend.jax.tower_function import traced_state
from kerastower.errors import KerasTowerError

__all__ = ["minimize_step"]


def minimize_step(optimizer, loss_fn, variables):
    """`kt.minimize` on JAX: `jax.value_and_grad` of the loss over the
    variables' values, in a stateless scope; what the loss assigns goes on."""
    state = traced_state()
    eager = state is None
    if eager:
        state = variables
    differentiated = {id(v) for v in variables}
    others = [v for v in state if id(v) not in differentiated]
    held = {id(v) for v in state}

    def loss_of(values):
        # collect_losses: the loss may add model.losses (activity regularizers).
        with jax_compat.inheriting_stateless_scope(list(zip(variables, values)),
                                                   collect_losses=True) as scope:
            before = [scope.state_mapping.get(id(v)) for v in others]
            loss = loss_fn()
            scaled = optimizer.scale_loss(loss)
        if set(scope.state_mapping) - held:
            raise KerasTowerError(
                "kt.minimize on JAX: the loss assigned variables other than those minimized "
                + ("(BatchNormalization statistics, a random seed's state), which only a tower "
                   "function carries on. Call it inside a kt.Trainer.tower_function."
                   if eager else "that the model and its optimizers do not hold, so their new "
                   "values would be lost. Keep them on the model (model.add_weight(...))."))
        # What the loss assigned (BatchNormalization's statistics, seeds) goes on.
        updates = {i: scope.state_mapping[id(v)] for i, v in enumerate(others)
                   if scope.state_mapping.get(id(v)) is not before[i]}
        return scaled, (loss, updates)

    (_, (loss, updates)), grads = jax.value_and_grad(loss_of, has_aux=True)(
        [v.value for v in variables])
    for i, value in updates.items():
        others[i].assign(value)
    optimizer.apply(grads, variables)
    return loss
