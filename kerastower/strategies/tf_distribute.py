"""TFDistributeStrategy: a TowerStrategy over a `tf.distribute.Strategy`.

The TensorFlow backend's strategies: "single" and "mirrored" (mirrored.py)
are this class over a OneDeviceStrategy or a MirroredStrategy; Horovod
(horovod.py) and multi-worker (multiworker.py) subclass it. It gives the
rest of kerastower the few operations it needs of TensorFlow, of three
kinds only. Place: where the towers run (`run`, `scope`) and where their
input pipelines are read (`place_input`). Reduce: all-reduce inside a
tower, gather or sum the towers' values, agree whether any process has
data left. Broadcast: the chief's state and objects. Which batch each
tower takes is the input layer's (kerastower/inputs/), and how a step
takes it the engine's (backend/tensorflow/feeding.py).
"""


import warnings

from kerastower._tf import tf
from kerastower import _compat
from kerastower.backend.tensorflow import collectives
from kerastower.errors import StrategyError
from kerastower.strategies.base import TowerStrategy

__all__ = ["TFDistributeStrategy"]


class TFDistributeStrategy(TowerStrategy):
    """Runs a step once per tower on a `tf.distribute.Strategy`.

    Args:
        name: the registry name this strategy was made from.
        tf_strategy: the `tf.distribute.Strategy` that places the towers.

    `kt.distributed(name)` makes one and enters it:

    Examples:
        >>> with kt.distributed("mirrored", devices=["/cpu:0", "/cpu:1"]) as strategy:
        ...     print(type(strategy).__name__, strategy.num_towers, strategy.single_process)
        TFDistributeStrategy 2 True
    """

    def __init__(self, name, tf_strategy):
        super().__init__(name)
        self.tf_strategy = tf_strategy

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
        values = self.tower_values(per_tower)
        if isinstance(values[0], tf.SparseTensor):  # as Keras joins sparse batches
            return tf.sparse.concat(axis=0, sp_inputs=list(values))
        return tf.concat(values, axis=0)

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

    def seed_towers_apart(self, model):
        """Gives every tower its own random streams (see tf_step)."""
        from kerastower.backend.tensorflow.tower_scope import seed_towers_apart
        seed_towers_apart(model)

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

    def any_process_has(self, has_data):
        """Inside a step function: whether `has_data` (this process's bool
        tensor: its towers have a batch left) holds on any process. The
        step runs while it does (backend/tensorflow/feeding.py); a process
        whose data ran out joins with empty batches. Return `has_data`
        itself when no agreement is needed (one process)."""
        return has_data

    def host_fed(self):
        """Whether per-tower pipelines feed the towers from host iterators:
        on CPU devices tf.distribute's per-device prefetch (a
        MultiDeviceIterator) costs a step more than it saves."""
        return self.num_towers > 1 and isinstance(
            self.tf_strategy, tf.distribute.MirroredStrategy
        ) and not any("GPU" in d.upper() for d in self.tf_strategy.extended.worker_devices)

    def place_input(self, dataset_fn, per_tower):
        """Places an input pipeline on the towers: what a step takes its
        per-tower batches from (`iter` of it, read by feeding.py).

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

    # The input methods strategies had, kept for one release.

    def distribute(self, dataset_fn, per_tower):
        """Deprecated: `place_input` (the same arguments)."""
        warnings.warn(
            "TFDistributeStrategy.distribute is now place_input; distribute will be "
            "removed in the next release.", DeprecationWarning, stacklevel=2)
        return self.place_input(dataset_fn, per_tower)

    def next_step(self, iterator, endless=False):
        """Deprecated: `kerastower.backend.tensorflow.feeding.next_step(strategy,
        iterator, endless)`; a strategy now only agrees whether any process
        has data left (`any_process_has`)."""
        warnings.warn(
            "TFDistributeStrategy.next_step moved to kerastower.backend.tensorflow.feeding.next_step"
            "(strategy, iterator, endless); it will be removed from TowerStrategy in the next "
            "release.", DeprecationWarning, stacklevel=2)
        from kerastower.backend.tensorflow import feeding

        return feeding.next_step(self, iterator, endless)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "next_step" in vars(cls):
            # kerastower no longer calls it: what it did would be skipped.
            raise StrategyError(
                f"{cls.__name__} overrides next_step, which kerastower no longer calls: a "
                "strategy only places, reduces and broadcasts, and kerastower takes each "
                "step's batches itself. Override any_process_has(has_data) instead: inside a "
                "step, whether any process has data left (this process's bool tensor in, "
                "the agreed one out).")
        if "distribute" in vars(cls) and "place_input" not in vars(cls):
            warnings.warn(
                f"{cls.__name__} overrides TFDistributeStrategy.distribute, which is now place_input: "
                "it is used as place_input for one release; rename it.",
                DeprecationWarning, stacklevel=2)
            cls.place_input = vars(cls)["distribute"]
