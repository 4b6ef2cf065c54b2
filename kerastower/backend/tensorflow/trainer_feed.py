"""kt.Trainer's feed on TensorFlow: what `next_batches()` takes from.

A `kt.InputSource` or `tf.data.Dataset`, chosen by inputs/chooser.py and
placed by backend/tensorflow/inputs.py on the towers: tower k of step s takes the source's batch
s*N+k, through `feeding.next_step`.
"""

from kerastower.backend.tensorflow import feeding
from kerastower.errors import InputSourceError

__all__ = ["TensorFlowFeed"]


class TensorFlowFeed:
    """A `kt.InputSource` or `tf.data.Dataset`, placed on the towers by the strategy."""

    def __init__(self, input, owner):
        from kerastower.backend.tensorflow.inputs import place
        from kerastower.inputs.chooser import choose
        from kerastower.inputs.chooser import kind_of

        if kind_of(input) not in ("input_source", "dataset"):
            raise InputSourceError(
                f"{owner}: input must be a kt.InputSource or a tf.data.Dataset; got "
                f"{type(input).__name__}. Wrap arrays in "
                "tf.data.Dataset.from_tensor_slices(...).batch(n).repeat().")
        self.source = place(choose(input))
        self.iterator = None

    def reading(self):
        """The context a `train()` reads the input in (InputSource.reading)."""
        return self.source.reading()

    def open(self, engine, skip_batches):
        """Opens the input on `engine`'s towers (its generators' errors go to
        the engine's record), less the `skip_batches` each tower took before."""
        self.iterator = iter(engine.place(self.source, skip_batches=skip_batches))

    def next(self, strategy):
        """(one step's batches, examples by tower), or None at the input's end."""
        has_data, batches = feeding.next_step(strategy, self.iterator)
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
