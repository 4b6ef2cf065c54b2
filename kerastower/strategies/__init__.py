"""Strategies: where the towers run and how they place, reduce and broadcast.

`base.py` holds `kt.TowerStrategy`; `switch.py` the registry of names and
the `kt.distributed` switch; `mirrored.py` ("single", "mirrored"), `horovod.py` and
`multiworker.py` register the TensorFlow strategies, `jax_mesh.py` and
`jax_multihost.py` make the JAX ones; `devices.py` parses device names.
"""

from kerastower.strategies.base import TowerStrategy
from kerastower.strategies.switch import _on_jax
from kerastower.strategies.switch import _REGISTRY
from kerastower.strategies.switch import current_strategy
from kerastower.strategies.switch import distributed
from kerastower.strategies.switch import is_explicit
from kerastower.strategies.switch import register_strategy
from kerastower.strategies.switch import strategy_names

__all__ = [
    "TowerStrategy", "distributed", "register_strategy", "strategy_names",
    "current_strategy", "is_explicit",
]
