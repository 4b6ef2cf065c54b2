"""kerastower: tensorpack's tower and trainer semantics for Keras 3 `model.fit`.

```python
import kerastower as kt

@kt.distributed("mirrored")
def train():
    model = kt.TowerModel(inputs, outputs)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(kt.DatasetInput(dataset), epochs=3)   # dataset batches are per tower
```
"""

from kerastower._backend_required import check_backend_installed as _check_backend_installed
from kerastower._backend_required import running_backend as _running_backend

_check_backend_installed()  # before Keras is imported: a missing backend names its extra

from kerastower import _moved  # noqa: E402

_moved.install()

from kerastower import callbacks
from kerastower import checkpoint
from kerastower.backend.tensorflow.collectives import collectives_per_step
from kerastower.errors import ArgumentError
from kerastower.errors import DataMismatchError
from kerastower.errors import InputSourceError
from kerastower.errors import KerasTowerError
from kerastower.errors import MonitorWriteWarning
from kerastower.errors import NonFiniteError
from kerastower.errors import PeerFailureError
from kerastower.errors import StepFailedError
from kerastower.errors import StrategyError
from kerastower.errors import TowerRuleError
from kerastower.loop.main_loop import LoopState
from kerastower.strategies.base import TowerStrategy
from kerastower.strategies.switch import distributed
from kerastower.strategies.switch import register_strategy
from kerastower.strategies.switch import strategy_names
from kerastower.tower import TowerContext
from kerastower.tower import get_current_tower_context
from kerastower.loss_divisors import global_sum
from kerastower.loss_divisors import loss_divisor
from kerastower.inputs.chooser import register_input_kind
from kerastower.callbacks.monitors import optimizer_state_bytes

from kerastower.model import TowerModel
from kerastower.sequential import TowerSequential
from kerastower import functional as _functional  # registers the saved-model classes
from kerastower.trainers import GANModel
from kerastower.trainers import GANTrainer
from kerastower.trainers import SeparateGANTrainer
from kerastower.trainers import StopTraining
from kerastower.loop.preemption import Preempted
from kerastower.trainers import Trainer
from kerastower.trainers import minimize

_ON_JAX = _running_backend() == "jax"  # each backend's own modules are imported on it only
if not _ON_JAX:
    from kerastower.strategies import tf_backend as _tf_backend  # registers what kt.distributed needs of TF
    from kerastower.strategies import mirrored as _mirrored  # registers "single", "mirrored", "central"
    from kerastower.strategies import horovod as _horovod  # registers "horovod"; imports Horovod only when used
    from kerastower.strategies import multiworker as _multiworker  # registers "multiworker"
    from kerastower.strategies.devices import use_cpu_towers
    from kerastower.inputs.sources import DatasetInput
    from kerastower.inputs.sources import DummyConstantInput
    from kerastower.inputs.sources import GeneratorInput
    from kerastower.inputs.sources import InputSource
    from kerastower.inputs.sources import TowerInputContext
else:
    from kerastower.strategies.jax_mesh import use_cpu_towers  # registers JAX's strategies

# What only the TensorFlow backend has, and what to use on JAX instead.
_TENSORFLOW_ONLY = {
    "DatasetInput": "numpy arrays, a Python generator or a keras.utils.PyDataset",
    "DummyConstantInput": "numpy arrays, a Python generator or a keras.utils.PyDataset",
    "GeneratorInput": "the generator itself, passed to fit",
    "InputSource": "numpy arrays, a Python generator or a keras.utils.PyDataset",
    "TowerInputContext": "numpy arrays, a Python generator or a keras.utils.PyDataset",
}


def __getattr__(name):
    if _moved.is_moved(f"kerastower.{name}"):  # a module read as an attribute
        return _moved.attribute(f"kerastower.{name}")
    if name in _TENSORFLOW_ONLY and _ON_JAX:
        raise KerasTowerError(
            f"kt.{name} runs on TensorFlow only, and this process runs Keras on JAX "
            f"(KERAS_BACKEND=jax). On JAX use {_TENSORFLOW_ONLY[name]}; or set "
            "KERAS_BACKEND=tensorflow before Keras is imported."
        )
    raise AttributeError(f"module 'kerastower' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "collectives_per_step",
    "ArgumentError",
    "callbacks",
    "checkpoint",
    "DataMismatchError",
    "DatasetInput",
    "distributed",
    "DummyConstantInput",
    "GANModel",
    "GANTrainer",
    "GeneratorInput",
    "get_current_tower_context",
    "global_sum",
    "InputSource",
    "InputSourceError",
    "KerasTowerError",
    "LoopState",
    "loss_divisor",
    "minimize",
    "MonitorWriteWarning",
    "NonFiniteError",
    "optimizer_state_bytes",
    "PeerFailureError",
    "Preempted",
    "register_input_kind",
    "register_strategy",
    "SeparateGANTrainer",
    "StepFailedError",
    "StopTraining",
    "strategy_names",
    "StrategyError",
    "TowerContext",
    "TowerInputContext",
    "TowerModel",
    "TowerRuleError",
    "TowerSequential",
    "TowerStrategy",
    "Trainer",
    "use_cpu_towers",
]
if _ON_JAX:
    # `from kerastower import *` takes what this backend has.
    __all__ = [name for name in __all__ if name not in _TENSORFLOW_ONLY]
