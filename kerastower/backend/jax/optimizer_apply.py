"""A JAX step's update: the towers' reduced gradients through the optimizer's `stateless_apply`.

With gradient accumulation and a token-normalised loss, the micro-steps are
weighed by their joined token counts first (`_compat.count_weighted`), so
the k-th applies the gradient of all k micro-steps' tokens, and the loss
they log is made the cycle's joined token mean (`cycle_logged`).

Example:
    >>> import jax.numpy as jnp
    >>> from kerastower.backend.jax.optimizer_apply import applied
    >>> weight = keras.Variable(jnp.ones(2))
    >>> optimizer = keras.optimizers.SGD(0.5)
    >>> optimizer.build([weight])
    >>> new_weights, _ = applied(optimizer, [v.value for v in optimizer.variables],
    ...                          [jnp.ones(2)], [weight.value], None)
    >>> [float(v) for v in new_weights[0]]
    [0.5, 0.5]
"""

import jax.numpy as jnp

from kerastower import _compat
from kerastower.backend.jax import towers as jax_towers

__all__ = ["applied", "cycle_logged", "with_cycle_logged"]


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


def cycle_logged(model, optimizer_vars, metrics_before, metrics, count, num_towers):
    """(this tower's metric values with the loss tracker's total corrected,
    the new value of what the cycle logged), for a micro-step of gradient
    accumulation with a token-normalised loss of joined `count`
    (`_compat.cycle_logged_loss`); (`metrics`, None) otherwise. Inside the
    towers' shard_map: each tower adds its share of the correction (the
    towers' metric values are summed for the logs)."""
    optimizer = model.optimizer
    logged = _compat.loss_log_variable(optimizer) if count is not None else None
    if logged is None:
        return metrics, None
    position = {id(v): i for i, v in enumerate(model.metrics_variables)}
    total, seen = (position[id(v)] for v in _compat.tracker_sums(_compat.loss_tracker(model)))
    step = jnp.stack([metrics[total] - metrics_before[total], metrics[seen] - metrics_before[seen],
                      metrics_before[seen]]).astype("float32")
    summed = jax_towers.sum_over_towers(num_towers)
    step = step if summed is None else summed(step)
    optimizer_position = {id(v): i for i, v in enumerate(optimizer.variables)}
    correction, value = _compat.cycle_logged_loss(
        optimizer, step, count, lambda variable: optimizer_vars[optimizer_position[id(variable)]])
    metrics = list(metrics)
    metrics[total] = metrics[total] + (correction / num_towers).astype(metrics[total].dtype)
    return metrics, value


def with_cycle_logged(optimizer, optimizer_vars, value):
    """The optimizer's new values with what the cycle logged (`cycle_logged`'s
    value; None: unchanged)."""
    if value is None:
        return optimizer_vars
    optimizer_vars = list(optimizer_vars)
    index = [i for i, v in enumerate(optimizer.variables) if v is _compat.loss_log_variable(optimizer)][0]
    optimizer_vars[index] = value
    return optimizer_vars
