"""`kt.minimize` on TensorFlow: one optimizer step on a loss, by GradientTape."""

from kerastower._tf import tf

__all__ = ["minimize_step"]


def minimize_step(optimizer, loss_fn, variables):
    """`kt.minimize` on TensorFlow: the gradient of the scaled loss, applied
    (inside a tower, `optimizer.apply` reduces it over the towers first)."""
    with tf.GradientTape() as tape:
        loss = loss_fn()
        scaled = optimizer.scale_loss(loss)
    optimizer.apply(tape.gradient(scaled, variables), variables)
    return loss
