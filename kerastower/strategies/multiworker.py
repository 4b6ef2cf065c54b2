"""The multi-worker engine: tf.distribute's MultiWorkerMirroredStrategy.

For users without Horovod. Every worker runs the same script with its own
`TF_CONFIG` (the cluster's addresses and its own index):

    TF_CONFIG='{"cluster": {"worker": ["host1:12345", "host2:12345"]},
                "task": {"type": "worker", "index": 0}}' python train.py

```python
@kt.distributed("multiworker")     # create it first, before any other TF op
def train():
    ...
```

Each worker's devices are towers (worker w's replica i is tower
w * local_devices + i). A shared `kt.DatasetInput(dataset)` is sharded by
worker so that tower k of a step takes the step's k-th batch; a per-tower
`kt.DatasetInput(fn)` needs one device per worker (TF cannot build one
pipeline per replica there). Worker 0 is the chief: it writes logs and
checkpoints. Weights are broadcast from tower 0 when fit starts.
"""

import json
import os

import numpy as np
import tensorflow as tf

from kerastower.backend.tensorflow import collectives
from kerastower.errors import StrategyError
from kerastower.strategies.tf_distribute import TFDistributeStrategy
from kerastower.strategies.switch import register_strategy
from kerastower.checkpoint.training_state import training_state

__all__ = ["MultiWorkerStrategy", "worker_shard"]


def worker_shard(dataset, workers, worker, local_towers):
    """The batches of a shared pipeline that `worker` takes.

    Each step, the worker's `local_towers` towers take successive batches
    of its shard. Sharding in groups of `local_towers` makes towers in index
    order (worker-major) hold the step's batches in input order, so that
    predict's outputs, gathered in tower order, keep it.
    """
    if local_towers == 1:
        return dataset.shard(workers, worker)
    grouped = dataset.enumerate().filter(lambda i, _: (i // local_towers) % workers == worker)
    return grouped.map(lambda _, element: element)


class MultiWorkerStrategy(TFDistributeStrategy):
    """Towers on the devices of several worker processes, via collectives."""

    def __init__(self, devices=None):
        if devices is not None:
            raise StrategyError(
                '"multiworker" uses each worker\'s own devices; do not pass devices '
                f"(got {devices}). Set TF_CONFIG for every worker instead."
            )
        if "TF_CONFIG" not in os.environ:
            raise StrategyError(
                '"multiworker" needs the TF_CONFIG environment variable on every '
                "worker (the cluster's worker addresses and this worker's index); "
                "see docs/distributed.md. For one machine use \"mirrored\"."
            )
        try:
            tf_strategy = tf.distribute.MultiWorkerMirroredStrategy()
        except (RuntimeError, ValueError) as error:
            raise StrategyError(
                f"MultiWorkerMirroredStrategy could not start ({error}). It must be "
                'created before any other TensorFlow op: enter kt.distributed("multiworker") '
                "at the start of the program."
            ) from None
        super().__init__("multiworker", tf_strategy)
        resolver = tf_strategy.cluster_resolver
        self.worker_index = resolver.task_id or 0
        self.local_towers = len(tf_strategy.extended.worker_devices)
        self._process_sum = None   # sum_over_processes's tf.function, made once
        self._broadcast = None     # _from_tower_0's

    single_process = False

    @property
    def is_chief(self):
        return self.tf_strategy.extended.should_checkpoint

    def first_local_tower(self):
        return self.worker_index * self.local_towers

    def any_process_has(self, has_data):
        # TensorFlow's distributed iterator has agreed across workers
        # already (`has_data` is whether any worker has data left, and a
        # worker out of data gets empty batches): one collective of the step.
        collectives.note("all_reduce", 1, self.first_local_tower())
        return has_data

    def metrics_result(self, model):
        # One batched all-reduce of every metric's state (totals, counts),
        # instead of one per variable that reading them here would launch.
        metrics = list(model.metrics)

        def summed_in_tower():
            # This tower's own copy of each (sync-on-read) metric variable.
            return self.all_reduce_sum([tf.identity(v.value) for m in metrics for v in m.variables])

        summed = self.tf_strategy.run(summed_in_tower)
        return self.metrics_from_sums(metrics, [self.tower_values(v)[0] for v in summed])

    def local_metrics_result(self, model):
        # Read in cross-replica context, each metric variable would be
        # all-reduced; this worker's first tower's own reading launches none.
        return tf.nest.map_structure(
            lambda v: self.tower_values(v)[0], self.tf_strategy.run(model.get_metrics_result))

    def gather_tower_scalars(self, per_tower):
        collectives.note("all_gather", 1, self.first_local_tower())
        as_vectors = self.tf_strategy.run(lambda v: tf.reshape(v, [1]), args=(per_tower,))
        return tf.reshape(self.tf_strategy.gather(as_vectors, axis=0), [self.num_towers])

    def concat_tower_outputs(self, per_tower):
        collectives.note("all_gather", 1, self.first_local_tower())
        return self.tf_strategy.gather(per_tower, axis=0)

    def sum_over_towers(self, per_tower):
        collectives.note("all_reduce", 1, self.first_local_tower())
        as_float = self.tf_strategy.run(lambda v: tf.cast(v, tf.float64), args=(per_tower,))
        return self.tf_strategy.reduce(tf.distribute.ReduceOp.SUM, as_float, axis=None)

    def _from_tower_0(self, values):
        """Tower 0's `values` (tensors of the same shapes everywhere), on
        every worker: each tower adds its share, zero but on tower 0. One
        `tf.function`, traced again only for new shapes."""
        if self._broadcast is None:
            def share_of_tower_0(values):
                index = tf.distribute.get_replica_context().replica_id_in_sync_group
                return [tf.where(tf.equal(index, 0), v, tf.zeros_like(v)) for v in values]

            @tf.function(reduce_retracing=True)
            def broadcast(values):
                shares = self.tf_strategy.run(share_of_tower_0, args=(values,))
                return [self.tf_strategy.reduce(tf.distribute.ReduceOp.SUM, s, axis=None) for s in shares]

            self._broadcast = broadcast
        # Tensors, not the variables themselves: a trace takes a variable
        # argument by reference, and would go on reading the first ones.
        return self._broadcast([tf.convert_to_tensor(v) for v in values])

    def sync_initial_state(self, model):
        variables = training_state(model)
        for variable, value in zip(variables, self._from_tower_0([v.value for v in variables])):
            variable.assign(value)

    def all_agree(self, flag):
        """Whether `flag` holds on every worker: one all-reduce of a count."""
        return self.sum_over_processes([0 if flag else 1])[0] == 0

    def sum_over_processes(self, values):
        """One all-reduce: each worker's first tower adds `values`, the others zeros."""
        if self._process_sum is None:
            first_towers = self.local_towers

            def share(vector):
                index = tf.distribute.get_replica_context().replica_id_in_sync_group
                return tf.where(tf.equal(index % first_towers, 0), vector, tf.zeros_like(vector))

            @tf.function(input_signature=[tf.TensorSpec([None], tf.int32)])
            def summed(vector):
                shares = self.tf_strategy.run(share, args=(vector,))
                return self.tf_strategy.reduce(tf.distribute.ReduceOp.SUM, shares, axis=None)

            self._process_sum = summed
        return [int(v) for v in self._process_sum(tf.constant([int(v) for v in values], tf.int32)).numpy()]

    def broadcast_object(self, obj):
        data = np.frombuffer(json.dumps(obj).encode(), np.uint8).astype(np.int32)
        (length,) = self._from_tower_0([tf.constant(len(data), tf.int64)])
        padded = np.zeros(int(length), np.int32)
        padded[: min(len(data), len(padded))] = data[: len(padded)]
        (received,) = self._from_tower_0([tf.constant(padded)])
        return json.loads(bytes(np.asarray(received, np.uint8)).decode())

    def assign_per_tower(self, variable, value_fn):
        copies = self.tower_values(variable)
        main = tf.convert_to_tensor(copies[0])
        first = self.worker_index * self.local_towers
        for offset, copy in enumerate(copies):
            copy.assign(value_fn(first + offset, main))

    def place_input(self, dataset_fn, per_tower):
        if per_tower and self.local_towers > 1:
            raise StrategyError(
                "Per-tower pipelines under \"multiworker\" need one device per worker "
                f"(this worker has {self.local_towers}): TensorFlow builds one pipeline "
                "per worker there. Use a shared kt.DatasetInput(dataset), or one "
                "worker per device."
            )

        def worker_dataset(context):
            dataset = dataset_fn(context)
            if per_tower:
                return dataset
            return worker_shard(
                dataset, context.num_input_pipelines, context.input_pipeline_id, self.local_towers
            )

        return self.tf_strategy.distribute_datasets_from_function(worker_dataset)


register_strategy("multiworker", MultiWorkerStrategy)
