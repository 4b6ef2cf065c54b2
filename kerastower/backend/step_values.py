"""Values a tower step returns that are not metrics: which ones Keras logs.

keras.io's WGAN-GP returns `{"d_loss": d_loss, "g_loss": g_loss}` from its
`train_step`: values, not metrics. Keras logs what the step returns; so
does kerastower, reduced over the towers the way one device on the joined
batch would see a per-batch mean: the example-weighted mean of the towers'
values (`sum_k v_k * n_k / sum_k n_k`, a tower without examples weighted 0).
A step that returns only such values logs only them (the compiled loss
tracker, which nothing updated, does not appear). A value that is not a
scalar cannot be reduced that way and is left out, with a warning.

This module picks the values and names them in the logs; each backend
reduces them inside its step (`backend/tensorflow/step_values.py`: one
all-reduce in the towers; `backend/jax/step_values.py`: one `psum`).
"""

import warnings

import keras

__all__ = ["StepValues"]


class StepValues:
    """The non-metric values of one step function's tower step; the keys
    are found when the step is traced.

    Examples:
        >>> import numpy as np
        >>> from kerastower.backend.step_values import StepValues
        >>> values = StepValues("M.train_step")
        >>> values.pick({"loss": 1.0, "g_loss": np.float32(2.0)}, metric_keys={"loss"})
        ['g_loss']
        >>> values.logs({"loss": 1.0}, [2.5])
        {'loss': 1.0, 'g_loss': 2.5}
    """

    def __init__(self, step_name):
        self.step_name = step_name
        self.keys = []              # the scalar values' keys, in order
        self.metrics_returned = True

    def pick(self, outputs, metric_keys):
        """The keys of `outputs` (what the step returned) that are scalar
        values, not metrics; warns about the others."""
        outputs = outputs if isinstance(outputs, dict) else {}
        extra = sorted(set(outputs) - set(metric_keys))
        self.metrics_returned = not outputs or len(extra) < len(outputs)
        self.keys = [k for k in extra if keras.ops.ndim(outputs[k]) == 0]
        others = [k for k in extra if k not in self.keys]
        if others:
            warnings.warn(
                f"kerastower: {self.step_name} returned {others}, which are neither metrics "
                "nor scalars: they cannot be averaged over the towers and are not logged. "
                "Return scalars, or track such values with a keras.metrics.Metric.")
        return self.keys

    def logs(self, logs, values):
        """The step's logs: the metrics `logs` (unless the step returned only
        values) and `values[i]` under `keys[i]`."""
        if not self.keys:
            return logs
        named = dict(logs) if self.metrics_returned else {}
        for index, key in enumerate(self.keys):
            named[key] = values[index]
        return named
