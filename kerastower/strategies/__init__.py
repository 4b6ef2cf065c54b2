"""Strategies: where the towers run and how they place, reduce and broadcast.

`base.py` holds `kt.TowerStrategy`, the base of every strategy on both
backends; `switch.py` the one registry of names and the `kt.distributed`
switch. TensorFlow: `tf_distribute.py` holds `TFDistributeStrategy`, and
`tf_backend.py`, `mirrored.py` ("single", "mirrored"), `horovod.py` and
`multiworker.py` register TensorFlow's. JAX: `jax_local.py` holds
`JaxTowerStrategy`, and `jax_mesh.py` registers JAX's ("single",
"mirrored", `jax_multihost.py`'s "multihost"). `devices.py` parses
TensorFlow device names.
"""

from kerastower.strategies.base import TowerStrategy
from kerastower.strategies.switch import current_strategy
from kerastower.strategies.switch import distributed
from kerastower.strategies.switch import is_explicit
from kerastower.strategies.switch import register_strategy
from kerastower.strategies.switch import strategy_names
from kerastower.strategies.tf_distribute import TFDistributeStrategy

__all__ = [
    "TowerStrategy", "TFDistributeStrategy", "distributed", "register_strategy",
    "strategy_names", "current_strategy", "is_explicit",
]
