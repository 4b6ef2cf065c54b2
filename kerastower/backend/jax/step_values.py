"""Values a tower step returns that are not metrics, as Keras logs them (JAX).

As on TensorFlow (backend/tensorflow/step_values.py, which says why):
the values a `train_step` returns beside the model's metrics are logged,
reduced over the towers as the example-weighted mean of the towers' values;
a step that returns only values logs only them; a value that is not a
scalar is left out, with a warning. Inside the jitted step the reduction
is one `psum` over the towers' axis.
"""

import warnings

import jax
import jax.numpy as jnp

from kerastower.backend.jax.placement import AXIS

__all__ = ["StepValues"]


class StepValues:
    """The non-metric values of one model's train step (keys found when traced)."""

    def __init__(self, model):
        self.model = model
        self.keys = []
        self.metrics_returned = True

    def local(self, logs, examples):
        """Inside a tower: this tower's values times its examples, then its
        examples (a float32 vector)."""
        model = self.model
        metric_keys = set(model.get_metrics_result()) | {m.name for m in model.metrics}
        logs = logs if isinstance(logs, dict) else {}
        extra = sorted(set(logs) - metric_keys)
        self.metrics_returned = not logs or len(extra) < len(logs)
        scalars = [k for k in extra if jnp.ndim(logs[k]) == 0]
        others = [k for k in extra if k not in scalars]
        if others:
            warnings.warn(
                f"kerastower: {type(model).__name__}.train_step returned {others}, which are "
                "neither metrics nor scalars: they cannot be averaged over the towers and are "
                "not logged. Return scalars, or track such values with a keras.metrics.Metric.")
        self.keys = scalars
        count = jnp.asarray(examples, jnp.float32)
        return jnp.stack([jnp.asarray(logs[k], jnp.float32) * count for k in scalars] + [count])

    def reduced(self, local, over_towers):
        """The example-weighted mean over the towers (`over_towers`: inside
        the towers' shard_map)."""
        summed = jax.lax.psum(local, AXIS) if over_towers else local
        return summed[:-1] / jnp.maximum(summed[-1], 1.0)

    def logs(self, logs, values):
        """The step's logs: the metrics (unless the step returned only
        values) and the values."""
        if not self.keys:
            return logs
        logs = dict(logs) if self.metrics_returned else {}
        for index, key in enumerate(self.keys):
            logs[key] = values[index]
        return logs
