"""Strategies: where the towers run and how they combine, switched by one line.

```python
import kerastower as kt

@kt.distributed("mirrored")          # or "single"
def train():
    model = build_model()            # variables are created under the strategy
    model.compile(optimizer="adam", loss="mse")
    model.fit(kt.DatasetInput(dataset), epochs=2)
```

`kt.distributed(...)` is also a context manager. Each strategy is a
`TowerStrategy`: a thin wrapper over a `tf.distribute.Strategy` that gives the
rest of kerastower the few operations it needs (run a function once per tower,
all-reduce inside a tower, turn an InputSource into per-tower iterators).
The strategies register themselves with `register_strategy`: mirrored.py
("single", "mirrored"), horovod.py, multiworker.py; on JAX,
jax_mesh.py makes them.
"""

import functools
import threading
import warnings
import weakref

import keras

from kerastower._tf import tf
from kerastower import _compat
from kerastower.backend.tensorflow import collectives
from kerastower.strategies.devices import parse_devices
from kerastower.errors import StrategyError

__all__ = [
    "TowerStrategy",
    "distributed",
    "register_strategy",
    "strategy_names",
    "current_strategy",
    "is_explicit",
]


class TowerStrategy:
    """Runs a step once per tower on a `tf.distribute.Strategy`.

    Args:
        name: the registry name this strategy was made from.
        tf_strategy: the `tf.distribute.Strategy` that places the towers.

    Examples:
        >>> import kerastower as kt
        >>> with kt.distributed("mirrored", devices=["/cpu:0", "/cpu:1"]) as strategy:
        ...     print(strategy.num_towers)
        2
    """

    # Whether every tower runs in this process: then reading the towers'
    # values (a step's example counts, the metrics) needs no collective.
    single_process = True

    def __init__(self, name, tf_strategy):
        self.name = name
        self.tf_strategy = tf_strategy

    @property
    def is_chief(self):
        """Whether this process writes logs and checkpoints (always, in one process)."""
        return True

    @property
    def num_towers(self):
        return self.tf_strategy.num_replicas_in_sync

    def scope(self):
        return self.tf_strategy.scope()

    def tower_index(self):
        """The index of the tower whose step is being traced, as a Python int."""
        replica_ctx = tf.distribute.get_replica_context()
        if replica_ctx is None:
            raise StrategyError(
                "tower_index() was called outside a tower step (in cross-"
                "replica context); call it from inside a step."
            )
        index = tf.get_static_value(replica_ctx.replica_id_in_sync_group)
        if index is None:
            raise StrategyError(
                f"{type(self.tf_strategy).__name__} does not give a static "
                "replica index, which tower contexts need."
            )
        return int(index)

    def run(self, fn, args=()):
        """Calls `fn(*args)` once per tower; returns per-tower results."""
        return self.tf_strategy.run(fn, args=args)

    def tower_values(self, per_tower):
        """The list of one per-tower result's values, in tower order."""
        return list(self.tf_strategy.experimental_local_results(per_tower))

    def gather_tower_scalars(self, per_tower):
        """One scalar per tower -> a vector of them, in tower order."""
        return tf.stack(self.tower_values(per_tower))

    def step_examples(self, per_tower, reduced_counts=None):
        """The examples each tower's batch had in this step (int32 vector in
        tower order). `reduced_counts`, when the towers' counts were already
        summed over towers as a float vector (by `optimizer.apply`), spares
        a strategy whose towers span processes a gather."""
        if reduced_counts is not None and not self.single_process:
            return tf.cast(self.tower_values(reduced_counts)[0], tf.int32)
        return self.gather_tower_scalars(per_tower)

    def first_local_tower(self):
        """The index of this process's first tower."""
        return 0

    def concat_tower_outputs(self, per_tower):
        """Per-tower outputs -> one tensor, concatenated in tower order."""
        return tf.concat(self.tower_values(per_tower), axis=0)

    def sum_over_towers(self, per_tower):
        """Per-tower values -> their sum (float64, for exact counting)."""
        return tf.add_n([tf.cast(v, tf.float64) for v in self.tower_values(per_tower)])

    def metrics_result(self, model):
        """The model's metrics read across all towers (outside any tower)."""
        return model.get_metrics_result()

    def local_metrics_result(self, model):
        """The model's metrics as this process's towers have them (no
        collective): what a step gives batch-level callbacks when towers
        span processes."""
        return model.get_metrics_result()

    @staticmethod
    def metrics_from_sums(metrics, summed):
        """Each metric's result from its state variables' values summed over
        towers (totals and counts): the example-weighted result. `summed`
        lists the values of every metric's variables, metric by metric."""
        summed = iter(summed)
        results = {}
        for metric in metrics:
            result = metric.stateless_result([next(summed) for _ in metric.variables])
            if isinstance(result, dict):
                results.update(result)
            else:
                results[metric.name] = result
        return results

    def sync_initial_state(self, model):
        """Makes every tower start from the same variables (one process:
        mirrored variables already are)."""

    def seed_towers_apart(self, model):
        """Gives every tower its own random streams (see tf_step)."""
        from kerastower.backend.tensorflow.step import seed_towers_apart
        seed_towers_apart(model)

    def broadcast_object(self, obj):
        """The chief's `obj` (JSON-able), on every process."""
        return obj

    def all_reduce_sum(self, values):
        """Sums `values` (a list of tensors) over towers, inside a tower step."""
        if self.num_towers == 1 or not values:
            return list(values)
        collectives.note("all_reduce", len(values), self.first_local_tower())
        replica_ctx = tf.distribute.get_replica_context()
        return replica_ctx.all_reduce(tf.distribute.ReduceOp.SUM, list(values))

    def assign_per_tower(self, variable, value_fn):
        """Sets tower i's copy of a replica-local variable to
        `value_fn(i, tower 0's value)`; outside any step."""
        copies = self.tower_values(variable)
        main = tf.convert_to_tensor(copies[0])
        for index, copy in enumerate(copies):
            copy.assign(value_fn(index, main))

    def all_agree(self, flag):
        """Whether `flag` (a bool) holds on every process."""
        return bool(flag)

    def next_step(self, iterator, endless=False):
        """Inside a step function: (whether any tower has a batch left, a
        function giving this step's per-tower batches). Towers whose data has
        run out while others' has not get an empty batch. `endless` (every
        tower's input is endless, on every process) spares the processes
        agreeing on whether any has data."""
        optional = iterator.get_next_as_optional()
        return optional.has_value(), optional.get_value

    def host_fed(self):
        """Whether per-tower pipelines feed the towers from host iterators:
        on CPU devices tf.distribute's per-device prefetch (a
        MultiDeviceIterator) costs a step more than it saves."""
        return self.num_towers > 1 and isinstance(
            self.tf_strategy, tf.distribute.MirroredStrategy
        ) and not any("GPU" in d.upper() for d in self.tf_strategy.extended.worker_devices)

    def distribute(self, dataset_fn, per_tower):
        """Turns an input pipeline into a source of per-tower batches.

        Args:
            dataset_fn: `fn(input_context)` returning a `tf.data.Dataset`;
                `input_context.input_pipeline_id` is the tower index when
                `per_tower` is True.
            per_tower: True builds one pipeline per tower; False builds one
                pipeline that the towers take successive batches from.
        """
        if per_tower and self.num_towers > 1:
            options = tf.distribute.InputOptions(
                experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA,
                experimental_fetch_to_device=not self.host_fed(),
            )
            # TF 2.21's MirroredStrategy keeps the input devices of a
            # PER_REPLICA call for good, after which a shared pipeline feeds
            # every tower the same batch; put them back after the call.
            with _compat.input_devices_kept(self.tf_strategy):
                return self.tf_strategy.distribute_datasets_from_function(
                    dataset_fn, options
                )
        return self.tf_strategy.distribute_datasets_from_function(dataset_fn)

    def __repr__(self):
        return f"TowerStrategy({self.name!r}, towers={self.num_towers})"


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


def _active():
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


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
        self._scopes = []

    @property
    def strategy(self):
        """The `TowerStrategy`, made on first use and then reused."""
        if self._strategy is None:
            self._strategy = (_jax_strategies().make(self.name, self.devices) if _on_jax()
                              else _REGISTRY[self.name](self.devices))
        return self._strategy

    def __enter__(self):
        strategy = self.strategy
        scope = strategy.scope()
        scope.__enter__()
        self._scopes.append(scope)
        _active().append(strategy)
        if not _on_jax():
            _STOCK_FIT_CHECK.__enter__()
        return strategy

    def __exit__(self, *exc_info):
        if not _on_jax():
            _STOCK_FIT_CHECK.__exit__(*exc_info)
        _active().pop()
        return self._scopes.pop().__exit__(*exc_info)

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
