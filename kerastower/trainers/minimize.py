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

from kerastower import backend
from kerastower.errors import KerasTowerError
from kerastower.tower import get_current_tower_context

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
        >>> weight = keras.Variable(3.0)
        >>> optimizer = keras.optimizers.SGD(0.25)
        >>> optimizer.build([weight])
        >>> float(kt.minimize(optimizer, lambda: weight * weight, [weight]))
        9.0
        >>> float(weight.numpy())    # 3 - 0.25 * 2 * 3
        1.5
    """
    _check_held(optimizer)
    return backend.minimize_step()(optimizer, loss_fn, list(variables))


def _check_held(optimizer):
    """Inside a tower function, `optimizer` must be one the model holds:
    checkpoints save, and Horovod broadcasts, only those (and on JAX its
    new state would be lost)."""
    ctx = get_current_tower_context()
    held = None if ctx is None else ctx.held_optimizers
    if held is None or any(optimizer is known for known in held):
        return
    names = ", ".join(known.name for known in held) or "none"
    raise KerasTowerError(
        f"kt.minimize was given the optimizer {optimizer.name!r} "
        f"({type(optimizer).__name__}), which the model does not hold: checkpoints save, "
        "and Horovod broadcasts, only the optimizers the model holds (here: "
        f"{names}). Keep it on the model, as an attribute (model.g_optimizer = ...) or "
        "in a list or dict attribute (model.optimizers_of_cycle = [...]).")
