"""What `kt.distributed` needs of TensorFlow besides its named strategies.

Importing this module registers it (`switch.register_backend`):

- outside every block, the strategy in effect is a `TFDistributeStrategy`
  over TensorFlow's own: a `tf.distribute` scope the user entered, else
  one tower on the default device;
- device names are checked when the block is made, before anything runs;
- an open block holds two patches: stock Keras's `fit` warns once that a
  plain `keras.Model` is trained by stock Keras, with no towers; and a
  reset of TensorFlow's default graph (`keras.backend.clear_session()`,
  which keras-tuner calls before every trial) keeps the open blocks'
  strategy scopes entered.
"""

import warnings
import weakref

from kerastower._tf import tf
from kerastower import _compat
from kerastower.strategies import switch
from kerastower.strategies.devices import parse_devices
from kerastower.strategies.tf_distribute import TFDistributeStrategy

__all__ = []


def _default():
    tf_strategy = tf.distribute.get_strategy()
    if tf.distribute.has_strategy():
        return TFDistributeStrategy(type(tf_strategy).__name__, tf_strategy)
    return TFDistributeStrategy("single", tf_strategy)


def _checked_devices(devices, name):
    parsed = parse_devices(devices, name)
    return devices if parsed is None else [given for given, _ in parsed]


def _reenter_scopes(reset_graph):
    """Runs `reset_graph()` (TensorFlow's `reset_default_graph`) with this
    thread's open blocks kept: their strategy scopes, which live on the
    default graph, are left before the reset and entered again after, so
    what is built next is built under the block's strategy, as before."""
    blocks = switch.open_blocks()
    for block in reversed(blocks):
        block.scope.__exit__(None, None, None)
    try:
        return reset_graph()
    finally:
        for block in blocks:
            block.scope = block.strategy.scope()
            block.scope.__enter__()


_warned_stock_models = weakref.WeakSet()


def _warn_stock_fit(model):
    """A plain keras.Model fitted inside kt.distributed is trained by stock
    Keras: say so once, and how to get towers."""
    if hasattr(model, "tower_strategy") or model in _warned_stock_models:
        return  # a TowerModel
    if not switch.is_explicit() or switch.current_strategy().num_towers < 2:
        return
    strategy = switch.current_strategy()
    _warned_stock_models.add(model)
    warnings.warn(
        f"kerastower: {model.name} is a plain keras.Model, so stock Keras trains it "
        f"under {strategy}: each batch of batch_size examples is split over the "
        f"{strategy.num_towers} replicas, with no towers or per-tower batches. To train "
        "it with kerastower's towers, use kt.TowerModel(model) (created under the "
        "same kt.distributed) or build it as a kt.TowerModel.",
        stacklevel=3,
    )


switch.register_backend("tensorflow", switch.BackendStrategies(
    default=_default,
    block_patches=_compat.PatchGroup([_compat.stock_fit_checked(_warn_stock_fit),
                                      _compat.graph_reset_wrapped(_reenter_scopes)]),
    scope_entered=lambda: tf.distribute.has_strategy(),
    checked_devices=_checked_devices,
    hints={"multihost": '"multihost" is the JAX backend\'s (KERAS_BACKEND=jax); on TensorFlow, '
                        'several processes run under "multiworker" or "horovod".'},
))
