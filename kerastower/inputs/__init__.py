"""Where each tower gets its batch: every input kind `fit` takes.

Tower k of step s takes the source's batch s*N+k (N towers), whole: nothing
is split. `sources.py` holds the InputSources of the TensorFlow path
(`kt.DatasetInput`, `kt.GeneratorInput`, ...), `as_source.py` turns arrays,
datasets and generators into one; `arrays.py` deals numpy arrays out per tower;
`jax_sources.py` and `jax_arrays.py` do the same for the JAX path.
Generators and PyDatasets, on both backends: `dealing.py` decides which
batch each tower takes, `python_sources.py` reads the source in passes, and
`python_input.py` (TensorFlow) feeds it to tf.data.
"""

from kerastower.inputs.sources import DatasetInput
from kerastower.inputs.sources import DummyConstantInput
from kerastower.inputs.sources import GeneratorInput
from kerastower.inputs.sources import InputSource
from kerastower.inputs.sources import TowerInputContext
from kerastower.inputs.as_source import as_input_source

__all__ = [
    "InputSource", "DatasetInput", "GeneratorInput", "DummyConstantInput",
    "TowerInputContext", "as_input_source",
]
