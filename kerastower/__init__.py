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

from kerastower import callbacks
from kerastower import checkpoint
from kerastower.engine.collectives import collectives_per_step
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
from kerastower.loop import LoopState
from kerastower.strategies import _on_jax
from kerastower.strategies import TowerStrategy
from kerastower.strategies import distributed
from kerastower.strategies import register_strategy
from kerastower.strategies import strategy_names
from kerastower.tower import TowerContext
from kerastower.tower import get_current_tower_context

from kerastower.backend import TowerModel
from kerastower.trainers import GANModel
from kerastower.trainers import GANTrainer
from kerastower.trainers import SeparateGANTrainer
from kerastower.trainers import StopTraining
from kerastower.trainers import Trainer
from kerastower.trainers import minimize

if not _on_jax():
    from kerastower import functional as _functional  # registers the saved-model classes
    from kerastower import mirrored as _mirrored  # registers "single", "mirrored", "central"
    from kerastower import horovod as _horovod  # registers "horovod"; imports Horovod only when used
    from kerastower import multiworker as _multiworker  # registers "multiworker"
    from kerastower.devices import use_cpu_towers
    from kerastower.inputs import DatasetInput
    from kerastower.inputs import DummyConstantInput
    from kerastower.inputs import GeneratorInput
    from kerastower.inputs import InputSource
    from kerastower.inputs import TowerInputContext

# What only the TensorFlow backend has, and what to use on JAX instead.
_TENSORFLOW_ONLY = {
    "use_cpu_towers": "XLA_FLAGS=--xla_force_host_platform_device_count=N (before JAX starts)",
    "DatasetInput": "numpy arrays, a Python generator or a keras.utils.PyDataset",
    "DummyConstantInput": "numpy arrays, a Python generator or a keras.utils.PyDataset",
    "GeneratorInput": "the generator itself, passed to fit",
    "InputSource": "numpy arrays, a Python generator or a keras.utils.PyDataset",
    "TowerInputContext": "numpy arrays, a Python generator or a keras.utils.PyDataset",
}


def __getattr__(name):
    if name in _TENSORFLOW_ONLY and _on_jax():
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
    "InputSource",
    "InputSourceError",
    "KerasTowerError",
    "LoopState",
    "minimize",
    "MonitorWriteWarning",
    "NonFiniteError",
    "PeerFailureError",
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
    "TowerStrategy",
    "Trainer",
    "use_cpu_towers",
]
