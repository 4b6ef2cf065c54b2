"""TowerStrategy: the base of every strategy, on both backends.

A strategy says where the towers run and how they place, reduce and
broadcast; it never runs the loop (loop/main_loop.py runs every strategy
the same way). Each backend subclasses it once:

- TensorFlow: `TFDistributeStrategy` (tf_distribute.py), over a
  `tf.distribute.Strategy`: "single" and "mirrored" (mirrored.py), and its
  subclasses for Horovod (horovod.py) and several workers (multiworker.py).
- JAX: `JaxTowerStrategy` (jax_local.py), one tower per device of a mesh:
  "single" and "mirrored" (jax_mesh.py), and its subclass over every
  process's devices, "multihost" (jax_multihost.py).

The defaults here are those of one process, which has nothing to agree on
or broadcast; a strategy whose towers span processes overrides them.
`kt.register_strategy` (switch.py) names strategies for either backend.
"""

import contextlib

from kerastower.errors import StrategyError

__all__ = ["TowerStrategy", "SHARDED_OPTIMIZER_STRATEGIES"]

SHARDED_OPTIMIZER_STRATEGIES = (
    'Sharded optimizer state (docs/sharded-optimizer.md) exists under "single" and "mirrored" on '
    'JAX (KERAS_BACKEND=jax); not yet on TensorFlow\'s strategies, Horovod, "multiworker" or '
    '"multihost".')


class TowerStrategy:
    """The base of every strategy: where the towers run, how they reduce and broadcast.

    Args:
        name: the registry name this strategy was made from.

    A subclass says how many towers it runs (`num_towers`) and, where its
    towers span processes, how the processes reduce (`sum_over_processes`,
    `all_agree`) and broadcast (`broadcast_object`, `sync_initial_state`).
    Each backend's engine asks its own subclass for the rest:
    `TFDistributeStrategy` on TensorFlow, `JaxTowerStrategy` on JAX.

    Examples:
        >>> class OneProcess(kt.TowerStrategy):
        ...     num_towers = 1
        >>> strategy = OneProcess("mine")
        >>> strategy.sum_over_processes([2, 3]), strategy.all_agree(True), strategy
        ([2, 3], True, OneProcess('mine', towers=1))
    """

    # Whether every tower runs in this process: then reading the towers'
    # values (a step's example counts, the metrics) needs no collective.
    single_process = True
    # Whether each tower keeps only its piece of the optimizer's state
    # (`shard_optimizer_state`).
    shards_optimizer_state = False

    def __init__(self, name, *unexpected):
        if unexpected:
            raise StrategyError(
                f"TowerStrategy({name!r}, ...) takes a name only: it is the base of every "
                f"backend's strategies; got also {unexpected!r}. To wrap a "
                "tf.distribute.Strategy, use kt.strategies.TFDistributeStrategy(name, "
                "tf_strategy).")
        self.name = name

    @property
    def is_chief(self):
        """Whether this process writes logs and checkpoints (always, in one process)."""
        return True

    @property
    def num_towers(self):
        """How many towers run a step, over every process."""
        raise NotImplementedError(f"{type(self).__name__} must say its num_towers.")

    def scope(self):
        """The scope models are built under (none: the engine places the state)."""
        return contextlib.nullcontext()

    def shard_optimizer_state(self):
        """Makes each of the N towers keep 1/N of the optimizer's state
        (`kt.distributed(..., shard_optimizer=True)`); raises StrategyError
        where this strategy cannot (`_shard_optimizer_state`)."""
        self._shard_optimizer_state()
        self.shards_optimizer_state = True

    def _shard_optimizer_state(self):
        raise StrategyError(
            f"{self!r} keeps the whole optimizer state on every tower: shard_optimizer=True is "
            f"not available under it. {SHARDED_OPTIMIZER_STRATEGIES} Or leave shard_optimizer off.")

    def broadcast_object(self, obj):
        """The chief's `obj` (JSON-able), on every process."""
        return obj

    def all_agree(self, flag):
        """Whether `flag` (a bool) holds on every process."""
        return bool(flag)

    def sum_over_processes(self, values):
        """`values` (a few Python ints, the same count on every process)
        summed over the processes of the run, outside a step: one
        all-reduce where there are several."""
        return [int(v) for v in values]

    def sync_initial_state(self, model):
        """Makes every tower start from the chief's variables (one process:
        they are one copy already)."""

    def seed_towers_apart(self, model):
        """Gives every tower its own random streams (the JAX step does it
        itself: nothing to do here)."""

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r}, towers={self.num_towers})"
