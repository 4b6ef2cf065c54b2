"""Where `kt.Trainer.next_batches()` takes its batches: one feed per backend.

On TensorFlow the input is a `kt.InputSource` or a `tf.data.Dataset`,
distributed by the strategy (inputs/sources.py). On JAX it is a Python generator,
iterator or iterable of batches, or a `keras.utils.PyDataset`, dealt out as
fit deals them (jax_sources.py): tower k of step s takes the source's batch
`s x N + k`. Either way every tower takes whole batches of its own and the
input must not end: an epoch is only the period at which callbacks run.
"""

import keras

from kerastower.errors import InputSourceError
from kerastower.strategies.switch import _on_jax

__all__ = ["feed_for"]


def feed_for(input, owner):
    """The feed of `owner` (the trainer's class name) over `input`, or None."""
    if input is None:
        return None
    return (JaxFeed if _on_jax() else TensorFlowFeed)(input, owner)


class TensorFlowFeed:
    """A `kt.InputSource` or `tf.data.Dataset`, distributed by the strategy."""

    def __init__(self, input, owner):
        from kerastower._tf import tf
        from kerastower.inputs.sources import InputSource
        from kerastower.inputs.sources import as_input_source

        if not isinstance(input, (InputSource, tf.data.Dataset)):
            raise InputSourceError(
                f"{owner}: input must be a kt.InputSource or a tf.data.Dataset; got "
                f"{type(input).__name__}. Wrap arrays in "
                "tf.data.Dataset.from_tensor_slices(...).batch(n).repeat().")
        self.source = as_input_source(input)
        self.iterator = None

    def open(self, strategy, skip_batches):
        self.iterator = iter(self.source.distribute(strategy, skip_batches=skip_batches))

    def next(self, strategy):
        """(one step's batches, examples by tower), or None at the input's end."""
        has_data, batches = strategy.next_step(self.iterator)
        if not bool(has_data):
            return None
        batches = batches()
        return batches, self._examples_in(strategy, batches)

    @staticmethod
    def _examples_in(strategy, batches):
        """Examples in one step's batches, by tower. A process sees its own
        towers' batches; with one tower per process (Horovod, multi-worker),
        the others are counted as the same size: an endless input gives
        every tower a whole batch."""
        from kerastower.backend.tensorflow.step import num_examples

        local = [int(num_examples(batch)) for batch in strategy.tower_values(batches)]
        num_towers = strategy.num_towers
        return (local * num_towers)[:num_towers] if len(local) < num_towers else local


class JaxFeed:
    """A generator, iterator, iterable or PyDataset of per-tower batches."""

    def __init__(self, input, owner):
        from kerastower.inputs import jax_sources

        if not jax_sources.is_batched(input):
            raise InputSourceError(
                f"{owner}: on JAX the input is a Python generator (or iterable) of "
                "batches or a keras.utils.PyDataset, each batch one tower's; got "
                f"{type(input).__name__}. For numpy arrays, yield their batches: "
                "(x[i:i + n] for i in itertools.cycle(range(0, len(x) - n + 1, n))).")
        self.source = jax_sources.tower_batches(input)
        self.iterator = None

    def open(self, strategy, skip_batches):
        skip = max(skip_batches) if skip_batches else 0
        self.iterator = self.source.endless(strategy.num_towers, skip_steps=skip)

    def next(self, strategy):
        """(one step's batches, a `TowerBatches`; examples by tower), or None
        at the input's end. Batches that differ only in their number of
        examples are joined, and the step runs as one tower on them."""
        from kerastower.backend.jax.tower_function import TowerBatches

        batches = next(self.iterator, None)
        if batches is None:
            return None
        return TowerBatches(batches), [len(keras.tree.flatten(b)[0]) for b in batches]
