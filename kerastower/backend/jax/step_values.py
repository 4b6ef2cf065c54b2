"""The values a JAX tower step returns, reduced over the towers.

Which values are logged, and how, is backend/step_values.py's; here they
are reduced with one `psum` over the towers' axis inside the jitted step.
"""

import jax
import jax.numpy as jnp
import keras

from kerastower.backend import step_values
from kerastower.backend.jax.placement import AXIS

__all__ = ["StepValues"]


class StepValues(step_values.StepValues):
    """The non-metric values of one of a model's steps (`step`: its name)."""

    def __init__(self, model, step="train_step"):
        super().__init__(f"{type(model).__name__}.{step}", own_step=step_values.is_own_step(model, step))
        self.model = model

    def local(self, logs, examples, metrics=None):
        """Inside a tower: this tower's values times its examples, whether
        each of `checked` differs from its metric's result here, then its
        examples (a float32 vector). `metrics`: this tower's metric
        variables after the step; without them a value under a metric's
        key is read as the metric."""
        model = self.model
        results = None
        if metrics is not None:
            mapping = list(zip(model.metrics_variables, metrics))
            with keras.StatelessScope(state_mapping=mapping):
                results = {m.name: m.result() for m in model.metrics}
        self.pick(logs, set(model.get_metrics_result()) | {m.name for m in model.metrics}, results)
        count = jnp.asarray(examples, jnp.float32)
        weighted = [jnp.asarray(logs[k], jnp.float32) * count for k in self.keys + self.checked]
        # A tower without examples ran no step worth comparing.
        differed = [d * (count > 0) for d in self.differences(logs, results or {})]
        return jnp.stack(weighted + differed + [count])

    def reduced(self, local, over_towers):
        """The example-weighted mean over the towers (`over_towers`: inside
        the towers' shard_map), then in how many towers each of `checked`
        differed."""
        summed = jax.lax.psum(local, AXIS) if over_towers else local
        means = len(self.keys) + len(self.checked)
        return jnp.concatenate([summed[:means] / jnp.maximum(summed[-1], 1.0), summed[means:-1]])
