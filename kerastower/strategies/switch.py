"""`kt.distributed`: one line switches the strategy the towers run under.

```python
import kerastower as kt

@kt.distributed("mirrored")          # or "single", "horovod", "multiworker"
def train():
    model = build_model()            # variables are created under the strategy
    model.compile(optimizer="adam", loss="mse")
    model.fit(kt.DatasetInput(dataset), epochs=2)
```

`kt.distributed(...)` is also a context manager. One registry serves both
backends: each backend's strategy modules register their names with
`register_strategy` (TensorFlow: mirrored.py "single", "mirrored",
"central", horovod.py, multiworker.py; JAX: jax_mesh.py "single",
"mirrored", "multihost") and, with `register_backend`, what a block needs
of that backend besides: the strategy outside every block, the patches an
open block holds, how devices are checked. `_running()` is the one place
here that asks which backend Keras runs. `current_strategy()` is the
strategy in effect, which models are created under.
"""

import functools
import threading
import warnings

from kerastower._backend_required import running_backend
from kerastower.arguments import boolean
from kerastower.errors import StrategyError

__all__ = [
    "distributed",
    "register_strategy",
    "register_backend",
    "BackendStrategies",
    "strategy_names",
    "current_strategy",
    "is_explicit",
    "open_blocks",
]

_BACKEND_NAMES = ("tensorflow", "jax")

# name -> factory, per backend: filled by the modules that make strategies.
_REGISTRY = {backend: {} for backend in _BACKEND_NAMES}


class BackendStrategies:
    """What `kt.distributed` needs of a backend besides its named strategies.

    Registered once per backend by its strategy modules (`register_backend`).

    Args:
        default: `default()`, the strategy in effect outside every block.
        block_patches: what an open block holds entered (a context manager
            entered and left by every block; nested blocks share it).
        scope_entered: `scope_entered()`, whether the user entered the
            backend's own strategy scope (a `tf.distribute` one) outside
            kerastower; default: never.
        checked_devices: `checked_devices(devices, name)`, the devices as a
            block keeps them, raising `StrategyError` at once on a bad one;
            default: kept as given (the strategy checks them when made).
        hints: {name: sentence} for the names other backends have, said
            when one is asked for here.

    Examples:
        >>> import contextlib
        >>> from kerastower.strategies.switch import BackendStrategies
        >>> entry = BackendStrategies(default=lambda: None, block_patches=contextlib.nullcontext())
        >>> entry.checked_devices(["a"], "mine"), entry.scope_entered()
        (['a'], False)
    """

    def __init__(self, default, block_patches, scope_entered=None, checked_devices=None, hints=None):
        self.default = default
        self.block_patches = block_patches
        self.scope_entered = scope_entered or (lambda: False)
        self.checked_devices = checked_devices or (lambda devices, name: devices)
        self.hints = dict(hints or {})


_BACKENDS = {}


def register_backend(backend, strategies):
    """Registers `strategies` (a `BackendStrategies`) as `backend`'s: done
    once by each backend's strategy modules, when kerastower is imported."""
    _BACKENDS[_checked_backend(backend)] = strategies


def _checked_backend(backend):
    if backend not in _BACKEND_NAMES:
        raise StrategyError(
            f"backend must be one of {', '.join(map(repr, _BACKEND_NAMES))} (Keras's backend "
            f"names); got {backend!r}.")
    return backend


def _running_backend():
    """The name of the backend Keras runs: the one place kt.distributed asks."""
    return running_backend()


def _running():
    """The `BackendStrategies` of the backend Keras runs."""
    backend = _running_backend()
    if backend not in _BACKENDS:
        raise StrategyError(
            f"kerastower has no strategies for Keras's {backend!r} backend: it runs on "
            f"{' and '.join(_BACKEND_NAMES)}. Set KERAS_BACKEND to one of them before "
            "Keras is imported.")
    return _BACKENDS[backend]


def register_strategy(name, factory, backend=None):
    """Adds `name` to the strategies `kt.distributed` accepts.

    Args:
        name: the name `kt.distributed(name)` takes.
        factory: `factory(devices)` returning a `kt.TowerStrategy` (on
            TensorFlow a `kt.strategies.TFDistributeStrategy`, on JAX a
            `kerastower.strategies.jax_local.JaxTowerStrategy`); `devices`
            is what `kt.distributed` was given (None: the default devices).
        backend: "tensorflow" or "jax", the backend the name is for;
            default: the one Keras runs.

    Examples:
        >>> import tensorflow as tf
        >>> def first_cpu(devices):
        ...     return kt.strategies.TFDistributeStrategy("first_cpu", tf.distribute.OneDeviceStrategy("/cpu:0"))
        >>> kt.register_strategy("first_cpu", first_cpu, backend="tensorflow")
        >>> with kt.distributed("first_cpu") as strategy:
        ...     print(strategy.num_towers)
        1
    """
    if not isinstance(name, str) or not name:
        raise StrategyError(f"A strategy name must be a non-empty str; got {name!r}.")
    if not callable(factory):
        raise StrategyError(
            f"register_strategy({name!r}, factory): factory must be callable as "
            f"factory(devices), returning a kt.TowerStrategy; got {factory!r}.")
    backend = _running_backend() if backend is None else backend
    _REGISTRY[_checked_backend(backend)][name] = factory


def strategy_names():
    """The names `kt.distributed` accepts on the backend Keras runs, sorted.

    Examples:
        >>> {"single", "mirrored"} <= set(kt.strategy_names())
        True
    """
    return sorted(_REGISTRY.get(_running_backend(), {}))


_local = threading.local()


class _OpenBlock:
    """A `kt.distributed` block open in this thread: its strategy and the
    `tf.distribute` scope it holds entered (replaced when a graph reset
    re-enters it)."""

    __slots__ = ("strategy", "scope")

    def __init__(self, strategy, scope):
        self.strategy = strategy
        self.scope = scope


def open_blocks():
    """This thread's open `kt.distributed` blocks, outermost first."""
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _active():
    return [block.strategy for block in open_blocks()]


def is_explicit():
    """True inside `kt.distributed` or a scope of the backend's own
    strategies (a `tf.distribute` one; on JAX there is none: TensorFlow is
    not asked, nor imported)."""
    return bool(_active()) or _running().scope_entered()


def current_strategy():
    """The `TowerStrategy` in effect: the innermost `kt.distributed`, else
    the backend's default (on TensorFlow: a plain `tf.distribute` scope the
    user entered, else one tower on the default device)."""
    if _active():
        return _active()[-1]
    return _running().default()


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
        shard_optimizer: each of the N towers keeps 1/N of the optimizer's
            state, with the replicated run's numbers (docs/sharded-optimizer.md).
            A strategy that cannot raises `StrategyError` when it is made.

    Examples:
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

    def __init__(self, name="mirrored", devices=None, shard_optimizer=False):
        backend = _running()
        if name not in _REGISTRY[_running_backend()]:
            hint = backend.hints.get(name)
            raise StrategyError(
                f"Unknown strategy {name!r}. Valid names: "
                + ", ".join(repr(n) for n in strategy_names())
                + "." + (" " + hint if hint else "")
            )
        self.name = name
        self.devices = backend.checked_devices(devices, name)
        self.shard_optimizer = boolean(shard_optimizer, "shard_optimizer", f"kt.distributed({name!r})")
        self._backend = _running_backend()
        self._strategy = None
        self._blocks = []

    @property
    def strategy(self):
        """The `TowerStrategy`, made on first use and then reused."""
        if self._strategy is None:
            strategy = _REGISTRY[self._backend][self.name](self.devices)
            if self.shard_optimizer:
                strategy.shard_optimizer_state()
            self._strategy = strategy
        return self._strategy

    def __enter__(self):
        strategy = self.strategy
        patches = _running().block_patches
        patches.__enter__()   # first: if Keras moved, nothing else is entered
        try:
            scope = strategy.scope()
            scope.__enter__()
        except BaseException:
            patches.__exit__(None, None, None)
            raise
        block = _OpenBlock(strategy, scope)
        self._blocks.append(block)
        open_blocks().append(block)
        return strategy

    def __exit__(self, *exc_info):
        block = self._blocks.pop()
        blocks = open_blocks()
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
            _running().block_patches.__exit__(*exc_info)
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def run_under_strategy(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        return run_under_strategy

    def __repr__(self):
        sharded = ", shard_optimizer=True" if self.shard_optimizer else ""
        return f"distributed({self.name!r}, devices={self.devices}{sharded})"
