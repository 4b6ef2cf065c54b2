"""Values a tower step returns that are not metrics, as Keras logs them.

keras.io's WGAN-GP returns `{"d_loss": d_loss, "g_loss": g_loss}` from its
`train_step`: values, not metrics. Keras logs what the step returns; so
does kerastower, reduced over the towers the way one device on the joined
batch would see a per-batch mean: the example-weighted mean of the towers'
values (`sum_k v_k * n_k / sum_k n_k`, a tower without examples weighted 0).
A step that returns only such values logs only them (the compiled loss
tracker, which nothing updated, does not appear). A value that is not a
scalar cannot be reduced that way and is left out, with a warning.

The reduction is one all-reduce inside the towers, so it also spans the
processes of Horovod and multiworker runs.
"""

import warnings

import tensorflow as tf

__all__ = ["StepValues"]


class StepValues:
    """The non-metric values of one step function's tower step.

    Args:
        metric_keys: the keys that are the model's metrics.
        step_name: the step's name, for the warning.
    """

    def __init__(self, metric_keys, step_name):
        self.metric_keys = metric_keys
        self.step_name = step_name
        self.keys = []            # the scalar values' keys, in order, once traced
        self.metrics_returned = True

    def local(self, outputs, examples):
        """Inside a tower: this tower's values times its examples, then its
        examples (a float32 vector); None when the step returns no value."""
        if not isinstance(outputs, dict):
            return None
        extra = sorted(set(outputs) - self.metric_keys)
        self.metrics_returned = len(extra) < len(outputs)
        scalars = [k for k in extra if tf.convert_to_tensor(outputs[k]).shape.rank == 0]
        others = [k for k in extra if k not in scalars]
        if others:
            warnings.warn(
                f"kerastower: {self.step_name} returned {others}, which are neither metrics "
                "nor scalars: they cannot be averaged over the towers and are not logged. "
                "Return scalars, or track such values with a keras.metrics.Metric.")
        self.keys = scalars
        if not scalars:
            return None
        count = tf.cast(examples, tf.float32)
        weighted = [tf.where(count > 0, tf.cast(outputs[k], tf.float32) * count, 0.0) for k in scalars]
        return tf.stack(weighted + [count])

    def idle(self):
        """`local` of a tower that did not run the step (no example)."""
        return tf.zeros([len(self.keys) + 1], tf.float32)

    def reduced(self, local, strategy):
        """Inside a tower: the example-weighted mean of every tower's values."""
        (summed,) = strategy.all_reduce_sum([local])
        return tf.math.divide_no_nan(summed[:-1], summed[-1])

    def logs(self, logs, values):
        """The step function's logs: the metrics (unless the step returned
        only values) and the values of the last step (`values`, a vector,
        empty when no step ran: then NaN)."""
        if not self.keys:
            return logs
        logs = dict(logs) if self.metrics_returned else {}
        padded = tf.concat([values, tf.fill([len(self.keys)], float("nan"))], axis=0)
        for index, key in enumerate(self.keys):
            logs[key] = padded[index]
        return logs
