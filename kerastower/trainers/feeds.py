"""Where `kt.Trainer.next_batches()` takes its batches: the backend's feed.

On TensorFlow the input is a `kt.InputSource` or a `tf.data.Dataset`,
distributed by the strategy (backend/tensorflow/trainer_feed.py). On JAX it
is a Python generator, iterator or iterable of batches, or a
`keras.utils.PyDataset`, dealt out as fit deals them
(backend/jax/trainer_feed.py). Either way tower k of step s takes the
source's batch `s x N + k`, every tower whole batches of its own, and the
input must not end: an epoch is only the period at which callbacks run.
"""

from kerastower import backend

__all__ = ["feed_for"]


def feed_for(input, owner):
    """The feed of `owner` (the trainer's class name) over `input`, or None."""
    if input is None:
        return None
    return backend.trainer_feed()(input, owner)
