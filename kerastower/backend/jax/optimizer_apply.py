"""A JAX step's update: the towers' reduced gradients through the optimizer's `stateless_apply`.

With gradient accumulation and a token-normalised loss, the micro-steps are
weighed by their joined token counts first (`_compat.count_weighted`), so
the k-th applies the gradient of all k micro-steps' tokens.

Example:
    >>> import jax.numpy as jnp, keras
    >>> from kerastower.backend.jax.optimizer_apply import applied
    >>> weight = keras.Variable(jnp.ones(2))
    >>> optimizer = keras.optimizers.SGD(0.5)
    >>> optimizer.build([weight])
    >>> new_weights, _ = applied(optimizer, [v.value for v in optimizer.variables],
    ...                          [jnp.ones(2)], [weight.value], None)
    >>> [float(v) for v in new_weights[0]]
    [0.5, 0.5]
"""

from kerastower import _compat

__all__ = ["applied"]


def applied(optimizer, optimizer_vars, gradients, trainable, count):
    """(new trainable values, new optimizer values): the optimizer's
    `stateless_apply`; with gradient accumulation and a token-normalised
    loss (its joined `count`, else None), its micro-steps weighed by their
    tokens (`_compat.count_weighted`)."""
    counts = _compat.loss_count_variable(optimizer) if count is not None else None
    if counts is None or not _compat.accumulation_steps(optimizer):
        return tuple(map(list, optimizer.stateless_apply(optimizer_vars, gradients, trainable)))
    position = {id(v): i for i, v in enumerate(optimizer.variables)}

    def read(variable):
        return optimizer_vars[position[id(variable)]]

    # `stateless_apply`'s gradients are those of the variables it was built on.
    weighted, total = _compat.count_weighted(
        optimizer, gradients, _compat.optimizer_variables(optimizer), count, read)
    new_trainable, new_optimizer = map(list, optimizer.stateless_apply(optimizer_vars, weighted, trainable))
    new_optimizer[position[id(counts)]] = total
    return new_trainable, new_optimizer
