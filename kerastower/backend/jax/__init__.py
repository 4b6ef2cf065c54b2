"""The JAX step engine: towers as the devices of a mesh, one jitted step.

`step.py` runs the model's own JAX `train_step` once per tower inside one
`shard_map` and reduces the gradients there; `finite_check.py` checks
one tower's gradients for NaN/Inf from the products that made them;
`placement.py` puts each tower's batch on its device; `towers.py` what
every tower step does to its values; `tower_state.py` what the towers
hold between calls and when the Keras variables get it; `feed.py` fit's
input, read and launched ahead; `sync.py` synchronized BatchNormalization;
`metric_reset.py` Keras's `reset_metrics` without a device op per variable.
"""
