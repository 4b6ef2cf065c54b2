"""The JAX engine's placing of each kind of input the chooser decided.

`inputs/chooser.py` decides what an input is and which batch each tower
takes of it; here each kind becomes what the JAX steps read, per-tower
batches in numpy, which placement.py puts on the towers' devices:

- `arrays`: `ArrayBatches` (array_batches.py);
- `batches`: the source of batches of python_sources.py;
- `dataset`: read as an iterable of numpy batches, as Keras on JAX reads a
  `tf.data.Dataset`: each pass iterates it afresh;
- `input_source`: refused: a `kt.InputSource` is TensorFlow's.
"""

from kerastower.backend.jax.array_batches import ArrayBatches
from kerastower.errors import InputSourceError
from kerastower.inputs import python_sources
from kerastower.inputs.chooser import choose

__all__ = ["place", "tower_batches"]


def place(choice):
    """The per-tower batches of an `InputChoice`."""
    if choice.kind == "arrays":
        return ArrayBatches(choice.x, choice.y, choice.sample_weight, choice.batch_size,
                            choice.shuffle)
    if choice.kind == "input_source":
        raise InputSourceError(
            f"A kt.{type(choice.x).__name__} feeds TensorFlow's towers; on JAX pass numpy "
            "arrays, a tf.data.Dataset, a Python generator or iterable of batches, or a "
            "keras.utils.PyDataset.")
    return python_sources.python_batches(choice.x, shuffle=choice.shuffle)


def tower_batches(x, y=None, sample_weight=None, batch_size=None, shuffle=False):
    """What fit, evaluate or predict received, chosen and placed as per-tower batches.

    Examples:
        >>> from kerastower.backend.jax.inputs import tower_batches
        >>> type(tower_batches(np.ones((4, 2)), batch_size=2)).__name__
        'ArrayBatches'
        >>> type(tower_batches(iter([np.ones((4, 2))]))).__name__
        'GeneratorBatches'
    """
    if isinstance(x, (ArrayBatches, python_sources._Batches)):
        return x
    return place(choose(x, y, sample_weight, batch_size, shuffle))
