"""Values a tower step returns: which ones Keras logs, and how.

keras.io's WGAN-GP returns `{"d_loss": d_loss, "g_loss": g_loss}` from its
`train_step`: values, not metrics. Keras logs what the step returns; so
does kerastower, reduced over the towers the way one device on the joined
batch would see a per-batch mean: the example-weighted mean of the towers'
values (`sum_k v_k * n_k / sum_k n_k`, a tower without examples weighted 0).
A step that returns only such values logs only them (the compiled loss
tracker, which nothing updated, does not appear). A value that is not a
scalar cannot be reduced that way and is left out, with a warning.

A step may also return a value under a metric's own key. Keras hands its
batch callbacks what the step returned; at the end of an epoch (and of
evaluate) it logs the metrics' results when the step returned exactly
their keys (`Trainer._get_metrics_result_or_logs`), and otherwise what the
step returned. So does kerastower, when it is given the tower's metrics
(`results`): a value under a metric's key is that metric when it equals
the metric's own result in every tower (then the metric's exact
cross-tower result is logged), and a raw value when it does not in some
tower, such as `{"loss": loss}` computed by hand beside a loss tracker it
never updated (then the towers' mean is logged, as above); a metric the
step did not return is not logged; and where the step returned exactly
the metrics' keys, the end's logs (`final_logs`) are the metrics'
results. Keras's and kerastower's own steps return their metrics'
results by construction: for them (`own_step`) nothing is told apart, so
they add no all-reduce.

This module picks the values and names them in the logs; each backend
reduces them inside its step (`backend/tensorflow/step_values.py`: one
all-reduce in the towers; `backend/jax/step_values.py`: one `psum`).
"""

import warnings

import keras

__all__ = ["StepValues", "flat_results", "is_own_step"]

# How far (relative) a returned value may be from the metric's own result
# and still be that result: recomputed outside an XLA-compiled step, the
# same division may round differently.
_RELATIVE_TOLERANCE = 1e-6


def flat_results(results):
    """`{metric name: result}` -> `{key: result}`, a dict result's keys in
    place of its metric's name, as `Model.get_metrics_result` names them."""
    flat = {}
    for name, result in results.items():
        if isinstance(result, dict):
            flat.update(result)
        else:
            flat[name] = result
    return flat


def is_own_step(model, name):
    """Whether `model`'s step `name` ("train_step", "test_step") is Keras's
    or kerastower's own, which returns the metrics' results, not a user's."""
    module = getattr(getattr(type(model), name, None), "__module__", None) or ""
    return module.startswith(("keras.", "kerastower."))


def differs(returned, result):
    """1.0 where a returned scalar is not the metric's `result`, else 0.0."""
    a = keras.ops.cast(returned, "float32")
    b = keras.ops.cast(result, "float32")
    bound = _RELATIVE_TOLERANCE * keras.ops.maximum(keras.ops.abs(a), keras.ops.abs(b))
    same = keras.ops.logical_or(
        keras.ops.logical_or(keras.ops.equal(a, b), keras.ops.abs(a - b) <= bound),
        keras.ops.logical_and(keras.ops.isnan(a), keras.ops.isnan(b)))
    return keras.ops.cast(keras.ops.logical_not(same), "float32")


class StepValues:
    """The non-metric values of one step function's tower step; the keys
    are found when the step is traced.

    A tower's vector (`local`) holds each of `keys`' values, then each of
    `checked`'s, times the tower's examples; then, for each of `checked`,
    whether it differs from the metric's own result; then the examples.
    Reduced, it holds the means of the values, then the number of towers
    in which each of `checked` differs.

    Examples:
        >>> from kerastower.backend.step_values import StepValues
        >>> values = StepValues("M.train_step")
        >>> values.pick({"loss": 1.0, "g_loss": np.float32(2.0)}, metric_keys={"loss"})
        ['g_loss']
        >>> values.logs({"loss": 1.0}, [2.5])
        {'loss': 1.0, 'g_loss': 2.5}
        >>> values.pick({"loss": 3.0, "g_loss": 2.0}, {"loss"}, results={"loss": 0.0})
        ['g_loss']
        >>> values.checked
        ['loss']
    """

    def __init__(self, step_name, own_step=False):
        self.step_name = step_name
        self.own_step = own_step    # Keras's or kerastower's step: it returns the metrics
        self.keys = []              # the scalar values' keys, in order
        self.checked = []           # scalars under a metric's key, told apart at run time
        self.kept = None            # the metrics' keys logged as read; None: every one
        self.metrics_returned = True
        self.ends_with_metrics = False  # exactly the metrics' keys: the end logs the metrics

    def pick(self, outputs, metric_keys, results=None):
        """The keys of `outputs` (what the step returned) that are scalar
        values, not metrics; warns about the others. With `results` (this
        tower's metrics' results by metric name), also `checked` and
        `kept`, as the module says."""
        outputs = outputs if isinstance(outputs, dict) else {}
        extra = sorted(set(outputs) - set(metric_keys))
        self.keys = [k for k in extra if keras.ops.ndim(outputs[k]) == 0]
        others = [k for k in extra if k not in self.keys]
        if others:
            warnings.warn(
                f"kerastower: {self.step_name} returned {others}, which are neither metrics "
                "nor scalars: they cannot be averaged over the towers and are not logged. "
                "Return scalars, or track such values with a keras.metrics.Metric.")
        self.checked, self.kept, self.ends_with_metrics = [], None, False
        flat = None if results is None or self.own_step else flat_results(results)
        if flat is None or not outputs:
            self.metrics_returned = not outputs or len(extra) < len(outputs)
            return self.keys
        self.metrics_returned = False
        self.kept = []
        # Exactly the metrics' keys: batch callbacks get what the step
        # returned, the end of the epoch the metrics' results.
        self.ends_with_metrics = set(outputs) == set(flat)
        for key in outputs:
            if key in extra:
                continue
            if key in flat and keras.ops.ndim(outputs[key]) == 0 and keras.ops.ndim(flat[key]) == 0:
                self.checked.append(key)
            elif isinstance(results.get(key), dict):  # a metric of several results, by its name
                self.kept += [k for k in results[key] if k not in self.kept]
            elif key in flat:
                self.kept.append(key)
        return self.keys

    def differences(self, outputs, results):
        """For each of `checked`: whether `outputs` holds other than the
        metric's result there (1.0) or that result (0.0)."""
        flat = flat_results(results)
        return [differs(outputs[k], flat[k]) for k in self.checked]

    @property
    def size(self):
        """The length of a tower's vector (`local`)."""
        return len(self.keys) + 2 * len(self.checked) + 1

    def final_logs(self, logs):
        """What the end of an epoch (or of evaluate) logs after this step,
        where it is not the step's logs: the metrics' `logs`, when the step
        returned exactly their keys (as Keras); else None."""
        return dict(logs) if self.ends_with_metrics else None

    def logs(self, logs, values):
        """The step's logs: the metrics `logs` (unless the step returned only
        values, or other keys than theirs) and `values[i]` under `keys[i]`;
        under each of `checked`, the towers' mean where some tower's value
        differs from the metric's result, else the metric's `logs` entry."""
        if not self.keys and not self.checked and self.kept is None:
            return logs
        if self.kept is None:
            named = dict(logs) if self.metrics_returned else {}
        else:
            named = {k: logs[k] for k in self.kept if k in logs}
        for index, key in enumerate(self.keys):
            named[key] = values[index]
        first, count = len(self.keys), len(self.checked)
        for index, key in enumerate(self.checked):
            raw = values[first + index]
            differed = values[first + count + index]
            named[key] = keras.ops.where(differed > 0, raw, keras.ops.cast(logs[key], raw.dtype))
        return named
