"""`kt.minimize`: one optimizer step on a loss, the same code on every backend.

Inside a tower function, `kt.minimize(optimizer, loss_fn, variables)`
computes `loss_fn()` and its gradients with respect to `variables`, and
`optimizer.apply` averages them over the towers before it applies them, so
every tower makes the update of one device on the joined batch. On
TensorFlow the gradients come from a `tf.GradientTape`; on JAX from
`jax.value_and_grad` of the loss as a function of the variables' values,
inside the tower function's compiled step.

```python
import keras, numpy as np, kerastower as kt

class Regression(kt.Trainer):
    def run_step(self):
        return self.hooked_run(self.fit_batch, self.next_batches())

    @kt.Trainer.tower_function
    def fit_batch(self, batch):
        x, y = batch
        dense = self.model.dense
        def loss():
            return keras.ops.mean(keras.ops.square(dense(x) - y))
        return {"loss": kt.minimize(self.model.optimizer, loss, dense.trainable_variables)}
```
"""

from kerastower.strategies.switch import _on_jax

__all__ = ["minimize"]


def minimize(optimizer, loss_fn, variables):
    """Takes one step of `optimizer` on `loss_fn()` for `variables`; returns the loss.

    `loss_fn` takes no argument and returns a scalar loss. Inside a tower
    function the gradients are averaged over the towers (each tower weighted
    by its batch's share of the step's examples) and checked for NaN/Inf
    before the update. The loss is scaled by `optimizer.scale_loss` (mixed
    precision) for the gradients; the value returned is not scaled.

    Args:
        optimizer: a built Keras optimizer held by the model.
        loss_fn: a function of no argument returning the scalar loss.
        variables: the variables to update.

    Examples:
        >>> import keras, kerastower as kt
        >>> weight = keras.Variable(3.0)
        >>> optimizer = keras.optimizers.SGD(0.25)
        >>> optimizer.build([weight])
        >>> float(kt.minimize(optimizer, lambda: weight * weight, [weight]))
        9.0
        >>> float(weight.numpy())    # 3 - 0.25 * 2 * 3
        1.5
    """
    variables = list(variables)
    if _on_jax():
        return _minimize_on_jax(optimizer, loss_fn, variables)
    from kerastower._tf import tf

    with tf.GradientTape() as tape:
        loss = loss_fn()
        scaled = optimizer.scale_loss(loss)
    optimizer.apply(tape.gradient(scaled, variables), variables)
    return loss


def _minimize_on_jax(optimizer, loss_fn, variables):
    import jax

    from kerastower._compat import on_jax as jax_compat
    from kerastower.backend.jax.tower_function import traced_state

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
            from kerastower.errors import KerasTowerError

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
