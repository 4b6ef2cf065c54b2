"""The values a TensorFlow tower step returns, reduced over the towers.

Which values are logged, and how, is backend/step_values.py's; here they
are reduced with one all-reduce inside the towers, so the reduction also
spans the processes of Horovod and multiworker runs. A step that returns
only its metrics' results adds no all-reduce.
"""

import tensorflow as tf

from kerastower.backend import step_values

__all__ = ["StepValues"]


class StepValues(step_values.StepValues):
    """The non-metric values of one step function's tower step.

    Args:
        metric_keys: the keys that are the model's metrics.
        step_name: the step's name, for the warning.
        model: the model, whose metrics' results in each tower tell a raw
            value returned under a metric's key from that metric's result;
            without it such a value is read as the metric.
        own_step: whether the step is Keras's or kerastower's own, which
            returns its metrics' results (nothing to tell apart).
    """

    def __init__(self, metric_keys, step_name, model=None, own_step=False):
        super().__init__(step_name, own_step)
        self.metric_keys = metric_keys
        self.model = model

    def local(self, outputs, examples):
        """Inside a tower: this tower's values times its examples, whether
        each of `checked` differs from its metric's result here, then its
        examples (a float32 vector); None when there is nothing to reduce."""
        # This tower's own reading of its (sync-on-read) metric variables.
        results = (None if self.model is None
                   else {m.name: m.result() for m in self.model.metrics})
        self.pick(outputs, self.metric_keys, results)
        if not self.keys and not self.checked:
            return None
        count = tf.cast(examples, tf.float32)
        weighted = [tf.where(count > 0, tf.cast(outputs[k], tf.float32) * count, 0.0)
                    for k in self.keys + self.checked]
        # A tower without examples ran no step worth comparing.
        differed = [tf.where(count > 0, d, 0.0) for d in self.differences(outputs, results or {})]
        return tf.stack(weighted + differed + [count])

    def idle(self):
        """`local` of a tower that did not run the step (no example)."""
        return tf.zeros([self.size], tf.float32)

    def reduced(self, local, strategy):
        """Inside a tower: the example-weighted mean of every tower's
        values, then in how many towers each of `checked` differed."""
        (summed,) = strategy.all_reduce_sum([local])
        means = len(self.keys) + len(self.checked)
        return tf.concat([tf.math.divide_no_nan(summed[:means], summed[-1]), summed[means:-1]], 0)

    def logs(self, logs, values):
        """As the base's; `values` is empty when no step ran: then NaN (and
        the metrics under `checked`)."""
        if not self.keys and not self.checked:
            return super().logs(logs, values)
        return super().logs(logs, tf.concat([values, tf.fill([self.size - 1], float("nan"))], 0))
