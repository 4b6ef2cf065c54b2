"""The TensorFlow engine's placing of each kind of input the chooser decided.

`inputs/chooser.py` decides what an input is and which batch each tower
takes of it; here each kind becomes the `kt.InputSource` whose per-tower
datasets the strategy places on the towers:

- `input_source`: used as it is;
- `dataset`: a `kt.DatasetInput`;
- `arrays`: an `ArrayInput` (array_input.py), scipy sparse matrices and
  JAX BCOO arrays made the `tf.SparseTensor`s Keras makes of them here;
- `batches`: a `PythonSourceInput` (python_input.py), which feeds the
  source's batches to tf.data.
"""

from kerastower.backend.tensorflow.array_input import ArrayInput
from kerastower.backend.tensorflow.python_input import PythonSourceInput
from kerastower.inputs import python_sources
from kerastower.inputs import ragged_sparse
from kerastower.inputs.chooser import choose
from kerastower.inputs.sources import DatasetInput

__all__ = ["as_input_source", "place"]


def _tf_arrays(structure):
    """Arrays with every scipy sparse matrix and JAX BCOO made a `tf.SparseTensor`."""
    if structure is None:
        return None
    if ragged_sparse.is_sparse(structure):
        return ragged_sparse.as_tf_sparse(structure)
    if isinstance(structure, list):
        return [_tf_arrays(v) for v in structure]
    if isinstance(structure, tuple):
        return tuple(_tf_arrays(v) for v in structure)
    if isinstance(structure, dict):
        return {k: _tf_arrays(v) for k, v in structure.items()}
    return structure


def place(choice, repeat=False):
    """The `kt.InputSource` of an `InputChoice`; `repeat` makes arrays and
    Python sources endless (fit with `steps_per_epoch`)."""
    if choice.kind == "input_source":
        return choice.x
    if choice.kind == "dataset":
        return DatasetInput(choice.x)
    if choice.kind == "arrays":
        x, y, sample_weight = (_tf_arrays(a) for a in (choice.x, choice.y, choice.sample_weight))
        return ArrayInput(x, y, sample_weight, choice.batch_size, choice.shuffle, repeat)
    return PythonSourceInput(python_sources.python_batches(choice.x, shuffle=choice.shuffle), repeat)


def as_input_source(x, y=None, sample_weight=None, batch_size=None, shuffle=False, repeat=False):
    """What fit, evaluate or predict received, chosen and placed as a `kt.InputSource`.

    Examples:
        >>> from kerastower.backend.tensorflow.inputs import as_input_source
        >>> type(as_input_source(np.ones((4, 2)), batch_size=2)).__name__
        'ArrayInput'
    """
    return place(choose(x, y, sample_weight, batch_size, shuffle), repeat)
