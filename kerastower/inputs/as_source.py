"""`as_input_source`: what fit, evaluate and predict received, as an InputSource.

On TensorFlow: an InputSource is used as it is, a `tf.data.Dataset` becomes
a `DatasetInput`, numpy arrays (and scipy or JAX sparse matrices) an
`ArrayInput` (arrays.py) and a Python generator, iterable or
`keras.utils.PyDataset` a `PythonSourceInput` (python_input.py).
"""

import numpy as np

from kerastower._tf import tf
from kerastower.arguments import integer
from kerastower.errors import InputSourceError
from kerastower.inputs import python_sources
from kerastower.inputs import ragged_sparse
from kerastower.inputs.python_input import PythonSourceInput
from kerastower.inputs.sources import DatasetInput
from kerastower.inputs.sources import InputSource

__all__ = ["as_input_source"]


def _is_array(value):
    return isinstance(value, (np.ndarray, tf.Tensor, tf.RaggedTensor, tf.SparseTensor)) or (
        ragged_sparse.is_sparse(value)
    ) or (
        isinstance(value, (list, tuple, dict))
        and value
        and all(_is_array(v) for v in tf.nest.flatten(value))
    )


def _tf_arrays(structure):
    """Arrays with every scipy sparse matrix and JAX BCOO made the
    `tf.SparseTensor` Keras makes of it on TensorFlow."""
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


def as_input_source(x, y=None, sample_weight=None, batch_size=None, shuffle=False,
                    repeat=False):
    """Turns what fit/evaluate/predict received into an `InputSource`.

    `batch_size` is the per-tower batch for arrays (default 32); it must be
    None for datasets and InputSources, which are batched already. `repeat`
    makes arrays an endless source (fit with `steps_per_epoch`).
    """
    if isinstance(x, InputSource) or isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None:
            raise InputSourceError(
                f"y and sample_weight must be None when x is a "
                f"{type(x).__name__}: the dataset yields (x, y, sample_weight) "
                "itself."
            )
        if batch_size is not None:
            raise InputSourceError(
                f"batch_size={batch_size} was given with a {type(x).__name__}, "
                "which is batched already: batch the pipeline with the per-tower "
                "batch size and leave batch_size unset."
            )
        return x if isinstance(x, InputSource) else DatasetInput(x)
    if _is_array(x):
        batch_size = 32 if batch_size is None else integer(
            batch_size, "batch_size (per tower)", "kerastower", minimum=1
        )
        from kerastower.inputs.arrays import ArrayInput  # imports TensorFlow: not on JAX

        x, y, sample_weight = (_tf_arrays(a) for a in (x, y, sample_weight))
        return ArrayInput(x, y, sample_weight, batch_size, shuffle, repeat)
    if isinstance(x, tf.distribute.DistributedDataset) or hasattr(
        x, "_input_workers"
    ):
        raise InputSourceError(
            "Pass the tf.data.Dataset itself, or kt.DatasetInput(fn), not a "
            "distributed dataset: kerastower distributes it so that each tower "
            "takes whole batches of its own."
        )
    if python_sources.is_batched(x):
        return PythonSourceInput(
            python_sources.python_batches(x, y, sample_weight, batch_size, shuffle), repeat)
    raise InputSourceError(
        "fit/evaluate/predict take a kt.InputSource, a tf.data.Dataset, numpy "
        "arrays (or lists and dicts of them), a Python generator or iterable of "
        f"batches, or a keras.utils.PyDataset; got x of type {type(x).__name__}."
    )
