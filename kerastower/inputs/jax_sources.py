"""What the JAX engine reads: numpy arrays (jax_arrays.py) or a Python
source of batches (python_sources.py), as per-tower steps.

Keras on JAX reads a `tf.data.Dataset` as an iterable of numpy batches, and
so does kerastower: each pass iterates it afresh (`GeneratorBatches`).
"""

from kerastower.inputs.jax_arrays import ArrayBatches
from kerastower.inputs.python_sources import GeneratorBatches  # noqa: F401 (the old path's names)
from kerastower.inputs.python_sources import PyDatasetBatches  # noqa: F401
from kerastower.inputs.python_sources import _Batches
from kerastower.inputs.python_sources import is_batched
from kerastower.inputs.python_sources import python_batches

__all__ = ["tower_batches", "is_batched"]


def tower_batches(x, y=None, sample_weight=None, batch_size=None, shuffle=False):
    """What fit, evaluate and predict received, as per-tower batches.

    Examples:
        >>> import numpy as np
        >>> from kerastower.inputs.jax_sources import tower_batches
        >>> type(tower_batches(np.ones((4, 2)), batch_size=2)).__name__
        'ArrayBatches'
        >>> type(tower_batches(iter([np.ones((4, 2))]))).__name__
        'GeneratorBatches'
    """
    if isinstance(x, (ArrayBatches, _Batches)):
        return x
    if not is_batched(x):
        return ArrayBatches(x, y, sample_weight, batch_size or 32, shuffle)
    return python_batches(x, y, sample_weight, batch_size, shuffle)
