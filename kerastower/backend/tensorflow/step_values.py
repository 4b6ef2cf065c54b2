"""The values a TensorFlow tower step returns, reduced over the towers.

Which values are logged, and how, is backend/step_values.py's; here they
are reduced with one all-reduce inside the towers, so the reduction also
spans the processes of Horovod and multiworker runs.
"""

import tensorflow as tf

from kerastower.backend import step_values

__all__ = ["StepValues"]


class StepValues(step_values.StepValues):
    """The non-metric values of one step function's tower step.

    Args:
        metric_keys: the keys that are the model's metrics.
        step_name: the step's name, for the warning.
    """

    def __init__(self, metric_keys, step_name):
        super().__init__(step_name)
        self.metric_keys = metric_keys

    def local(self, outputs, examples):
        """Inside a tower: this tower's values times its examples, then its
        examples (a float32 vector); None when the step returns no value."""
        if not self.pick(outputs, self.metric_keys):
            return None
        count = tf.cast(examples, tf.float32)
        weighted = [tf.where(count > 0, tf.cast(outputs[k], tf.float32) * count, 0.0)
                    for k in self.keys]
        return tf.stack(weighted + [count])

    def idle(self):
        """`local` of a tower that did not run the step (no example)."""
        return tf.zeros([len(self.keys) + 1], tf.float32)

    def reduced(self, local, strategy):
        """Inside a tower: the example-weighted mean of every tower's values."""
        (summed,) = strategy.all_reduce_sum([local])
        return tf.math.divide_no_nan(summed[:-1], summed[-1])

    def logs(self, logs, values):
        """As the base's; `values` is empty when no step ran: then NaN."""
        if not self.keys:
            return logs
        return super().logs(logs, tf.concat([values, tf.fill([len(self.keys)], float("nan"))], 0))
