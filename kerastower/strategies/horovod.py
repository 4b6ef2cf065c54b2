"""The Horovod engine: one process per device, the same script on many machines.

```python
@kt.distributed("horovod")
def train():
    model = build_model()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    model.fit(kt.DatasetInput(dataset), steps_per_epoch=100, epochs=10)
```

    horovodrun -np 4 -H localhost:4 --gloo python train.py
    horovodrun -np 8 -H host1:4,host2:4 --gloo python train.py

Each process is one tower (`TowerContext.index` is the rank, `total` the
size), with tensorpack's HorovodTrainer semantics: a shared
`kt.DatasetInput(dataset)` is sharded by rank (rank r takes batches r,
r + size, ...), `kt.DatasetInput(fn)` builds `fn(ctx)` with ctx.index = rank;
gradients are summed with one grouped allreduce before the optimizer clips
them; weights and optimizer slots are broadcast from rank 0 when fit starts;
metrics are combined across ranks before callbacks see them; chief-only
callbacks, logs and checkpoints run on rank 0; each process sees the GPU of
its local rank. Horovod's own Keras integration does not work with Keras 3;
this uses only its core TensorFlow ops. Install: `bash scripts/install-horovod.sh`.
"""

import tensorflow as tf

from kerastower.backend.tensorflow import collectives
from kerastower.errors import StrategyError
from kerastower.strategies.tf_distribute import TFDistributeStrategy
from kerastower.strategies.switch import register_strategy
from kerastower.checkpoint.training_state import training_state

__all__ = ["HorovodStrategy"]


def _import_horovod():
    try:
        import horovod.tensorflow as hvd
    except ImportError as error:
        raise StrategyError(
            f'kt.distributed("horovod") needs Horovod, which is not importable ({error}). '
            "Install it for your TensorFlow with `bash scripts/install-horovod.sh` "
            "(from the kerastower repository), then launch with "
            "`horovodrun -np N -H localhost:N --gloo python your_script.py`."
        ) from None
    return hvd


class HorovodStrategy(TFDistributeStrategy):
    """One tower per Horovod process; collectives through Horovod's TF ops."""

    single_process = False

    def __init__(self, devices=None):
        if devices is not None:
            raise StrategyError(
                '"horovod" places one process per device itself (the GPU of its '
                f"local rank); do not pass devices (got {devices})."
            )
        hvd = _import_horovod()
        hvd.init()
        self.hvd = hvd
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            tf.config.set_visible_devices(gpus[hvd.local_rank() % len(gpus)], "GPU")
        super().__init__("horovod", tf.distribute.get_strategy())

    @property
    def num_towers(self):
        return self.hvd.size()

    @property
    def is_chief(self):
        return self.hvd.rank() == 0

    def tower_index(self):
        return self.hvd.rank()

    def run(self, fn, args=()):
        return fn(*args)

    def tower_values(self, per_tower):
        return [per_tower]

    def all_reduce_sum(self, values):
        values = list(values)
        if self.num_towers == 1 or not values:
            return values
        collectives.note("all_reduce", len(values))
        return self.hvd.grouped_allreduce(values, op=self.hvd.Sum)

    def first_local_tower(self):
        return self.hvd.rank()

    def gather_tower_scalars(self, per_tower):
        collectives.note("all_gather", 1)
        gathered = self.hvd.allgather(tf.reshape(per_tower, [1]))
        return tf.reshape(gathered, [self.num_towers])

    def concat_tower_outputs(self, per_tower):
        collectives.note("all_gather", 1)
        return self.hvd.allgather(per_tower)

    def sum_over_towers(self, per_tower):
        collectives.note("all_reduce", 1)
        return self.hvd.allreduce(tf.cast(per_tower, tf.float64), op=self.hvd.Sum)

    def metrics_result(self, model):
        # Sum every metric's state (totals, counts) over the ranks, then let
        # the metric compute its result from the sums: example-weighted.
        metrics = list(model.metrics)
        values = [v.value for m in metrics for v in m.variables]
        return self.metrics_from_sums(metrics, self.all_reduce_sum(values))  # one grouped allreduce

    def sync_initial_state(self, model):
        variables = training_state(model)
        for variable in variables:
            variable.assign(self.hvd.broadcast(variable.value, root_rank=0))

    def broadcast_object(self, obj):
        return self.hvd.broadcast_object(obj, root_rank=0)

    def assign_per_tower(self, variable, value_fn):
        main = self.hvd.broadcast(tf.convert_to_tensor(variable), root_rank=0)
        variable.assign(value_fn(self.hvd.rank(), main))

    def all_agree(self, flag):
        return bool(self.hvd.allreduce(tf.constant(int(bool(flag))), op=self.hvd.Min))

    def sum_over_processes(self, values):
        summed = self.hvd.allreduce(tf.constant([int(v) for v in values], tf.int32), op=self.hvd.Sum)
        return [int(v) for v in summed.numpy()]

    def any_process_has(self, has_data):
        collectives.note("all_reduce", 1)
        return self.hvd.allreduce(tf.cast(has_data, tf.int32), op=self.hvd.Max) > 0

    def place_input(self, dataset_fn, per_tower):
        context = tf.distribute.InputContext(
            num_input_pipelines=self.num_towers,
            input_pipeline_id=self.hvd.rank(),
            num_replicas_in_sync=self.num_towers,
        )
        dataset = dataset_fn(context)
        if not per_tower:
            dataset = dataset.shard(self.num_towers, self.hvd.rank())
        return dataset


register_strategy("horovod", HorovodStrategy)
