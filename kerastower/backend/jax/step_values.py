"""The values a JAX tower step returns, reduced over the towers.

Which values are logged, and how, is backend/step_values.py's; here they
are reduced with one `psum` over the towers' axis inside the jitted step.
"""

import jax
import jax.numpy as jnp

from kerastower.backend import step_values
from kerastower.backend.jax.placement import AXIS

__all__ = ["StepValues"]


class StepValues(step_values.StepValues):
    """The non-metric values of one of a model's steps (`step`: its name)."""

    def __init__(self, model, step="train_step"):
        super().__init__(f"{type(model).__name__}.{step}")
        self.model = model

    def local(self, logs, examples):
        """Inside a tower: this tower's values times its examples, then its
        examples (a float32 vector)."""
        model = self.model
        self.pick(logs, set(model.get_metrics_result()) | {m.name for m in model.metrics})
        count = jnp.asarray(examples, jnp.float32)
        return jnp.stack([jnp.asarray(logs[k], jnp.float32) * count for k in self.keys] + [count])

    def reduced(self, local, over_towers):
        """The example-weighted mean over the towers (`over_towers`: inside
        the towers' shard_map)."""
        summed = jax.lax.psum(local, AXIS) if over_towers else local
        return summed[:-1] / jnp.maximum(summed[-1], 1.0)
