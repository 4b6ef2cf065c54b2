"""`kt.distributed`: one line switches the strategy the towers run under.

```python
import kerastower as kt

@kt.distributed("mirrored")          # or "single", "horovod", "multiworker"
def train():
    model = build_model()            # variables are created under the strategy
    model.compile(optimizer="adam", loss="mse")
    model.fit(kt.DatasetInput(dataset), epochs=2)
```

`kt.distributed(...)` is also a context manager. The strategies register
their names with `register_strategy`: mirrored.py ("single", "mirrored"),
horovod.py, multiworker.py; on JAX, jax_mesh.py makes them.
`current_strategy()` is the one in effect, which models are created under.
"""

import functools
import threading
import warnings
import weakref

import keras

from kerastower._tf import tf
from kerastower import _compat
from kerastower.errors import StrategyError
from kerastower.strategies.base import TowerStrategy
from kerastower.strategies.devices import parse_devices

__all__ = [
    "distributed",
    "register_strategy",
    "strategy_names",
    "current_strategy",
    "is_explicit",
]


# Filled by the modules that make strategies: mirrored.py ("single",
# "mirrored", "central"), horovod.py and multiworker.py.
_REGISTRY = {}


def register_strategy(name, factory):
    """Makes `kt.distributed(name)` build `factory(devices)`.

    Args:
        name: the string users pass to `kt.distributed`.
        factory: `factory(devices)` returning a `TowerStrategy`; `devices` is
            the list the user gave, or None.

    Examples:
        >>> import tensorflow as tf, kerastower as kt
        >>> def first_cpu(devices):
        ...     return kt.TowerStrategy("first_cpu", tf.distribute.OneDeviceStrategy("/cpu:0"))
        >>> kt.register_strategy("first_cpu", first_cpu)
        >>> with kt.distributed("first_cpu") as strategy:
        ...     print(strategy.num_towers)
        1
    """
    if not isinstance(name, str) or not name:
        raise StrategyError(f"A strategy name must be a non-empty str; got {name!r}.")
    _REGISTRY[name] = factory


def strategy_names():
    """The names `kt.distributed` accepts, sorted.

    Examples:
        >>> import kerastower as kt
        >>> {"single", "mirrored", "horovod", "multiworker"} <= set(kt.strategy_names())
        True
    """
    return sorted(_REGISTRY)


_local = threading.local()


def _on_jax():
    return keras.backend.backend() == "jax"


def _jax_strategies():
    from kerastower.strategies import jax_mesh as jax_strategies  # imports JAX: only on that backend

    return jax_strategies


class _OpenBlock:
    """A `kt.distributed` block open in this thread: its strategy and the
    `tf.distribute` scope it holds entered (replaced when a graph reset
    re-enters it)."""

    __slots__ = ("strategy", "scope")

    def __init__(self, strategy, scope):
        self.strategy = strategy
        self.scope = scope


def _open_blocks():
    """This thread's open `kt.distributed` blocks, outermost first."""
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _active():
    return [block.strategy for block in _open_blocks()]


def _reenter_scopes(reset_graph):
    """Runs `reset_graph()` (TensorFlow's `reset_default_graph`, which
    `keras.backend.clear_session()` calls, keras-tuner before every trial)
    with this thread's open blocks kept: their strategy scopes, which live on
    the default graph, are left before the reset and entered again after, so
    what is built next is built under the block's strategy, as before."""
    blocks = _open_blocks()
    for block in reversed(blocks):
        block.scope.__exit__(None, None, None)
    try:
        return reset_graph()
    finally:
        for block in blocks:
            block.scope = block.strategy.scope()
            block.scope.__enter__()


def is_explicit():
    """True inside `kt.distributed` or a `tf.distribute` strategy scope (on
    JAX there is none: TensorFlow is not asked, nor imported)."""
    return bool(_active()) or (not _on_jax() and tf.distribute.has_strategy())


def current_strategy():
    """The `TowerStrategy` in effect: the innermost `kt.distributed`, else a
    plain `tf.distribute` scope the user entered, else one tower on the
    default device."""
    if _active():
        return _active()[-1]
    if _on_jax():
        return _jax_strategies().default()
    tf_strategy = tf.distribute.get_strategy()
    if tf.distribute.has_strategy():
        return TowerStrategy(type(tf_strategy).__name__, tf_strategy)
    return TowerStrategy("single", tf_strategy)


class distributed:
    """Runs a function, or a `with` block, under the named strategy.

    Args:
        name: one of `kt.strategy_names()`: "single" (one device), "mirrored"
            (one tower per device, variables mirrored, gradients all-reduced),
            "central" (raises: CentralStorageStrategy does not work with
            Keras 3; the error says why).
        devices: device names, e.g. ["/gpu:0", "/gpu:1"]; default: all GPUs,
            or all logical CPU devices when there is no GPU. A name that does
            not parse, or names a device twice, raises `StrategyError` here;
            a device this process lacks raises it when the strategy is made
            (entering the block), before anything runs on it.

    Examples:
        >>> import keras, numpy as np, kerastower as kt
        >>> @kt.distributed("mirrored", devices=["/cpu:0", "/cpu:1"])
        ... def train():
        ...     inputs = keras.Input((3,))
        ...     model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        ...     model.compile(optimizer="sgd", loss="mse")
        ...     model.fit(np.ones((32, 3)), np.ones((32, 1)), batch_size=8, verbose=0)
        ...     return model.loop.global_step     # 8 per tower, 16 per step
        >>> train()
        2
    """

    def __init__(self, name="mirrored", devices=None):
        if name not in _REGISTRY and not _on_jax():  # jax_strategies knows its own
            hint = (' "multihost" is the JAX backend\'s (KERAS_BACKEND=jax); on TensorFlow, '
                    'several processes run under "multiworker" or "horovod".'
                    if name == "multihost" else "")
            raise StrategyError(
                f"Unknown strategy {name!r}. Valid names: "
                + ", ".join(repr(n) for n in strategy_names())
                + "." + hint
            )
        parsed = None if _on_jax() else parse_devices(devices, name)
        self.name = name
        self.devices = devices if parsed is None else [given for given, _ in parsed]
        self._strategy = None
        self._blocks = []

    @property
    def strategy(self):
        """The `TowerStrategy`, made on first use and then reused."""
        if self._strategy is None:
            self._strategy = (_jax_strategies().make(self.name, self.devices) if _on_jax()
                              else _REGISTRY[self.name](self.devices))
        return self._strategy

    def __enter__(self):
        strategy = self.strategy
        patches = _block_patches()
        patches.__enter__()   # first: if Keras moved, nothing else is entered
        try:
            scope = strategy.scope()
            scope.__enter__()
        except BaseException:
            patches.__exit__(None, None, None)
            raise
        block = _OpenBlock(strategy, scope)
        self._blocks.append(block)
        _open_blocks().append(block)
        return strategy

    def __exit__(self, *exc_info):
        block = self._blocks.pop()
        blocks = _open_blocks()
        if block in blocks:
            blocks.remove(block)
        try:
            block.scope.__exit__(*exc_info)
        except Exception as exit_error:
            if exc_info[1] is not None:
                # The block's own error is the one to see; the scope's
                # failure to close is a consequence of it.
                warnings.warn(f"kerastower: leaving {self!r} after an error in the block, its "
                              f"strategy scope failed to close too ({exit_error!r}).",
                              stacklevel=2)
                return False
            raise StrategyError(
                f"Leaving {self!r}: its tf.distribute scope could not be closed "
                f"({type(exit_error).__name__}: {exit_error}). Something inside the block "
                "left it already or replaced TensorFlow's default graph under it (a scope "
                "entered inside the block and not left, or a tf.Graph made the default). "
                "Leave every scope you enter inside the block before the block ends."
            ) from exit_error
        finally:
            _block_patches().__exit__(*exc_info)
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def run_under_strategy(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        return run_under_strategy

    def __repr__(self):
        return f"distributed({self.name!r}, devices={self.devices})"


_warned_stock_models = weakref.WeakSet()


def _warn_stock_fit(model):
    """A plain keras.Model fitted inside kt.distributed is trained by stock
    Keras: say so once, and how to get towers."""
    if hasattr(model, "tower_strategy") or model in _warned_stock_models:
        return  # a TowerModel
    if not is_explicit() or current_strategy().num_towers < 2:
        return
    strategy = current_strategy()
    _warned_stock_models.add(model)
    warnings.warn(
        f"kerastower: {model.name} is a plain keras.Model, so stock Keras trains it "
        f"under {strategy}: each batch of batch_size examples is split over the "
        f"{strategy.num_towers} replicas, with no towers or per-tower batches. To train "
        "it with kerastower's towers, use kt.TowerModel(model) (created under the "
        "same kt.distributed) or build it as a kt.TowerModel.",
        stacklevel=3,
    )


# Stock Keras's fit checks its model only inside a kt.distributed block:
# outside every block, Keras runs unpatched.
_STOCK_FIT_CHECK = _compat.stock_fit_checked(_warn_stock_fit)


# `keras.backend.clear_session()` inside a block keeps the block's strategy.
_SCOPES_KEPT_ON_RESET = _compat.graph_reset_wrapped(_reenter_scopes)
_TENSORFLOW_BLOCK_PATCHES = _compat.PatchGroup([_STOCK_FIT_CHECK, _SCOPES_KEPT_ON_RESET])


def _block_patches():
    """The patches a kt.distributed block holds while it is open; outside
    every block, Keras runs unpatched. TensorFlow: stock Keras's fit checks
    its model, and a reset of the default graph (`clear_session()`) keeps
    the open blocks' strategy scopes. JAX: BatchNormalization(synchronized=True)
    builds, and its moments are kerastower's (backend/jax/sync.py)."""
    if not _on_jax():
        return _TENSORFLOW_BLOCK_PATCHES
    from kerastower.backend.jax import sync  # imports JAX: only on that backend

    return sync.SYNCHRONIZED_BATCHNORM
