"""Where each tower gets its batch: every input kind `fit` takes, chosen once for both backends.

Tower k of step s takes the source's batch s*N+k (N towers), whole: nothing
is split. `chooser.py` decides which kind each input is (a `kt.InputSource`,
a `tf.data.Dataset`, arrays, a Python source of batches, or a kind
registered with `kt.register_input_kind`); what each tower takes of it is
decided here too: `array_rows.py` cuts arrays' passes into per-tower
batches, `dealing.py` deals a Python source's batches, which
`python_sources.py` reads in passes. `sources.py` holds the InputSources of
the TensorFlow path (`kt.DatasetInput`, `kt.GeneratorInput`, ...). Each
engine only places what was chosen: backend/tensorflow/inputs.py and
backend/jax/inputs.py.
"""

from kerastower.inputs.sources import DatasetInput
from kerastower.inputs.sources import DummyConstantInput
from kerastower.inputs.sources import GeneratorInput
from kerastower.inputs.sources import InputSource
from kerastower.inputs.sources import TowerInputContext
from kerastower.inputs.chooser import InputChoice
from kerastower.inputs.chooser import choose
from kerastower.inputs.chooser import register_input_kind

__all__ = [
    "InputSource", "DatasetInput", "GeneratorInput", "DummyConstantInput",
    "TowerInputContext", "InputChoice", "choose", "register_input_kind",
]
