"""Resetting a model's metrics on JAX without an eager op per variable.

Keras resets a metric by assigning a Python `0` to each of its variables;
on JAX each such assign converts the scalar on the device, an eager
dispatch (0.03-0.1 ms on a 2-core VM, more while a step runs). Keras resets
every metric at every epoch's start, so a small model's fit of one step
spent 0.2 of its 1.4-1.8 ms there, more than anything else of its own.

Where a metric's `reset_state` is one of Keras's own that writes zeros (the
base `Metric`'s, `Mean`'s and `Sum`'s, which `MeanMetricWrapper` metrics
such as accuracy inherit), the same variables get zeros already on the
device, kept from the first reset. The metrics `compile(metrics=...)` made
are reset metric by metric, by the same rule. Any other `reset_state` (a
metric of the user's, or a Keras one that writes more than zeros) runs as
it is.

    inputs = keras.Input((3,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    model.fit(np.ones((8, 3)), np.ones((8, 1)), verbose=0)
    model.reset_metrics()  # on JAX, by MetricResets
    assert all(float(keras.ops.max(v)) == 0 for v in model.metrics_variables)
"""

import jax
import keras
import numpy as np

from kerastower._compat import on_jax as _compat_jax

__all__ = ["MetricResets"]


def _mean_variables(metric):
    return (metric.total, metric.count)


def _sum_variables(metric):
    return (metric.total,)


# Keras's resets that write zeros, and the variables each writes.
_ZEROING_RESETS = {
    keras.metrics.Metric.reset_state: lambda metric: metric.variables,
    keras.metrics.Mean.reset_state: _mean_variables,
    keras.metrics.Sum.reset_state: _sum_variables,
}


class MetricResets:
    """Resets a model's metrics as `keras.Model.reset_metrics` does, keeping
    the zeros it writes on the device (the JAX engine holds one per model).

    A zero array is kept per variable, never shared: a variable's value
    may be donated to a jitted call, which deletes it, and a deleted one
    is made again.
    """

    def __init__(self):
        self._zeros = {}  # id(variable) -> its zeros on the device

    def reset(self, model):
        """Resets every metric of `model`."""
        for metric in model.metrics:
            self._reset(metric)

    def _reset(self, metric):
        parts = _compat_jax.compile_metrics_parts(metric)
        if parts is not None:
            for part in parts:
                self._reset(part)
            return
        zeroed = _ZEROING_RESETS.get(getattr(type(metric), "reset_state", None))
        if zeroed is None or "reset_state" in vars(metric):  # a reset set on the metric itself
            metric.reset_state()
            return
        for variable in zeroed(metric):
            variable.assign(self._zeros_of(variable))

    def _zeros_of(self, variable):
        array = self._zeros.get(id(variable))
        # As JAX holds it: without x64, an int64 variable holds int32.
        dtype = jax.dtypes.canonicalize_dtype(variable.dtype)
        if array is None or array.is_deleted() or array.shape != tuple(variable.shape) or array.dtype != dtype:
            array = jax.device_put(np.zeros(variable.shape, dtype))
            self._zeros[id(variable)] = array
        return array
