"""Inference on validation sources during training, data-parallel and exact.

```python
import kerastower as kt

kt.callbacks.InferenceRunner(
    (x_val, y_val),                       # or a dataset / InputSource
    [kt.callbacks.ScalarStats(["loss", "accuracy"]),  # -> val_loss, val_accuracy
     kt.callbacks.ClassificationError()],              # -> val_error
)
```

Every example is counted once: the towers take successive batches of the
source, towers left without a batch at the end contribute nothing, and sums
are exact counts. Results are added to the logs of the hook that triggered
the runner (the epoch logs by default), so Keras callbacks later in the
list (History, CSVLogger, EarlyStopping, ...) see them.

The runner runs on every process (its evaluation is collective: every
process evaluates its share and the sums are reduced across them), and
every process gets the same results. It may run mid-epoch
(`PeriodicTrigger(runner, every_k_steps=k)`): the training metrics it
resets to evaluate are put back afterwards, so the epoch's training logs
are those of training alone.
"""

import contextlib

import keras
import numpy as np

from kerastower._tf import tf
from kerastower import _compat
from kerastower.callbacks.base import Callback
from kerastower.strategies.base import _on_jax

__all__ = ["InferenceRunner", "Inferencer", "ScalarStats", "ClassificationError"]


class Inferencer:
    """One kind of result an InferenceRunner computes over a source.

    Subclasses implement `_batch_sums(y, y_pred, sample_weight)`, returning a
    dict of scalar sums for one tower's batch, and `_results(sums)`, turning
    the sums over the whole source into the named results. `ScalarStats`
    instead asks the model's compiled metrics.

    Examples:
        >>> import keras, numpy as np, kerastower as kt
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> import tensorflow as tf
        >>> class MeanPrediction(kt.callbacks.Inferencer):
        ...     def _batch_sums(self, y, y_pred, sample_weight):
        ...         return {"total": tf.reduce_sum(y_pred), "count": tf.cast(tf.size(y_pred), tf.float32)}
        ...     def _results(self, sums):
        ...         return {"val_mean_prediction": float(sums["total"] / sums["count"])}
        >>> runner = kt.callbacks.InferenceRunner((x, y), [MeanPrediction()])
        >>> history = model.fit(x, y, batch_size=4, verbose=0, callbacks=[runner])
        >>> bool(np.isclose(history.history["val_mean_prediction"][0], model.predict(x, verbose=0).mean()))
        True
    """

    def _batch_sums(self, y, y_pred, sample_weight):
        raise NotImplementedError

    def _results(self, sums):
        raise NotImplementedError


class ScalarStats(Inferencer):
    """The model's compiled loss and metrics on the source, named
    `<prefix>_<name>`.

    Args:
        names: metric names as in the training logs ("loss", "accuracy").
        prefix: what the results start with.

    Examples:
        >>> import keras, numpy as np, kerastower as kt
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> stats = kt.callbacks.ScalarStats(["loss", "mae"], prefix="test")
        >>> history = model.fit(x, y, batch_size=4, verbose=0,
        ...                     callbacks=[kt.callbacks.InferenceRunner((x, y), [stats])])
        >>> sorted(history.history)
        ['loss', 'mae', 'test_loss', 'test_mae']
    """

    def __init__(self, names=("loss",), prefix="val"):
        self.names = [names] if isinstance(names, str) else list(names)
        self.prefix = prefix


class ClassificationError(Inferencer):
    """The fraction of examples whose arg-max prediction is not the label.

    Labels may be class indices or one-hot; `sample_weight` weights the
    examples when the source gives one.

    Examples:
        >>> import keras, numpy as np, kerastower as kt
        >>> inputs = keras.Input((2,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(2, activation="softmax")(inputs))
        >>> model.compile(optimizer=keras.optimizers.SGD(0.0), loss="sparse_categorical_crossentropy")
        >>> model.layers[-1].set_weights([np.eye(2), np.zeros(2)])   # predicts the larger input
        >>> x, y = np.array([[1.0, 0.0], [0.0, 1.0]] * 4), np.array([0, 1, 1, 1] * 2)
        >>> runner = kt.callbacks.InferenceRunner((x, y), [kt.callbacks.ClassificationError()])
        >>> model.fit(x, y, batch_size=4, verbose=0, callbacks=[runner]).history["val_error"]
        [0.25]
    """

    def __init__(self, summary_name="val_error"):
        self.summary_name = summary_name

    def _batch_sums(self, y, y_pred, sample_weight):
        ops = keras.ops
        # float64 for exact counts; JAX computes in float32 (its x64 is off),
        # exact up to 2**24 examples a batch, and the totals add up in float64.
        exact = "float32" if _on_jax() else "float64"
        y_pred = ops.convert_to_tensor(y_pred)
        predicted = ops.cast(ops.argmax(y_pred, axis=-1), "int32")
        labels = ops.convert_to_tensor(y)
        # One-hot labels have a column per class; class indices, of shape
        # (n,) or (n, 1), do not.
        if (len(labels.shape) == len(y_pred.shape) and y_pred.shape[-1] != 1
                and labels.shape[-1] == y_pred.shape[-1]):
            labels = ops.argmax(labels, axis=-1)
        labels = ops.reshape(ops.cast(labels, "int32"), ops.shape(predicted))
        weights = (
            ops.ones_like(predicted, exact)
            if sample_weight is None
            else ops.reshape(ops.cast(sample_weight, exact), ops.shape(predicted))
        )
        wrong = ops.cast(ops.not_equal(predicted, labels), exact)
        return {"wrong": ops.sum(wrong * weights), "total": ops.sum(weights)}

    def _results(self, sums):
        return {self.summary_name: float(sums["wrong"] / max(sums["total"], 1e-12))}


def _any_batch_size(spec):
    """A tensor's spec with any batch size; other specs as they are."""
    if isinstance(spec, tf.TensorSpec) and spec.shape.rank:
        return tf.TensorSpec([None] + spec.shape.as_list()[1:], spec.dtype, spec.name)
    return spec


@contextlib.contextmanager
def _training_metrics_kept(model):
    """Puts every metric variable back as it was, each tower's copy, after
    the block: evaluate resets the metrics the training logs are read from."""
    if _on_jax():
        with model.training_metrics_kept():
            yield
        return
    strategy = model.tower_strategy
    copies = [
        copy
        for metric in model.metrics
        for variable in metric.variables
        for copy in strategy.tower_values(getattr(variable, "value", variable))
    ]
    saved = [tf.identity(copy) for copy in copies]
    try:
        yield
    finally:
        for copy, value in zip(copies, saved):
            copy.assign(value)


class InferenceRunner(Callback):
    """Runs inferencers over a validation source whenever triggered (by
    default, at the end of every epoch) and adds their results to the logs.

    It runs on every process (`chief_only = False`): evaluation is
    collective, and every process gets the same results.

    Args:
        source: an InputSource, a `tf.data.Dataset`, or `(x, y)` /
            `(x, y, sample_weight)` arrays (batched with `batch_size` per tower).
        inferencers: a list of `ScalarStats`, `ClassificationError`, or other
            `Inferencer`s.
        batch_size: per-tower batch for arrays (default 32).

    Examples:
        >>> import keras, numpy as np, kerastower as kt
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((16, 3)), np.ones((16, 1))
        >>> runner = kt.callbacks.InferenceRunner((x, y), [kt.callbacks.ScalarStats(["loss"])], batch_size=4)
        >>> history = model.fit(x, y, batch_size=4, verbose=0, callbacks=[runner])
        >>> sorted(history.history)
        ['loss', 'val_loss']
        >>> bool(np.isclose(history.history["val_loss"][0], model.evaluate(x, y, verbose=0)))
        True
    """

    # Evaluation is collective: a process without the runner would leave
    # the others waiting for it.
    chief_only = False

    def __init__(self, source, inferencers, batch_size=None):
        super().__init__()
        self.source = _JaxSource(source, batch_size) if _on_jax() else _tf_source(source, batch_size)
        self.inferencers = list(inferencers)
        for inferencer in self.inferencers:
            if not isinstance(inferencer, Inferencer):
                raise TypeError(
                    f"InferenceRunner takes kt.callbacks.Inferencer objects; got {inferencer!r}."
                )
        self.results = {}
        self._sum_function = None

    def _trigger(self):
        self.results = {}
        stats = [i for i in self.inferencers if isinstance(i, ScalarStats)]
        counters = [i for i in self.inferencers if not isinstance(i, ScalarStats)]
        if stats:
            with _training_metrics_kept(self.model):
                values = self.model.evaluate(**self._evaluate_arguments(), verbose=0, return_dict=True)
            for inferencer in stats:
                for name in inferencer.names:
                    if name not in values:
                        raise KeyError(
                            f"ScalarStats: {name!r} is not a metric of the model; "
                            f"it has {sorted(values)}."
                        )
                    self.results[f"{inferencer.prefix}_{name}"] = float(values[name])
        if counters:
            sums = self._sums_over_source(counters)
            for index, inferencer in enumerate(counters):
                self.results.update(inferencer._results(sums[index]))
        if self.logs is not None:
            self.logs.update(self.results)

    def _evaluate_arguments(self):
        source = self.source
        if isinstance(source, _JaxSource):
            return {"x": source.x, "y": source.y, "batch_size": source.batch_size,
                    "sample_weight": source.sample_weight}
        return {"x": source}

    def _sums_over_source(self, counters):
        """Per-inferencer sums over every example of the source, all towers."""
        if isinstance(self.source, _JaxSource):
            return self.source.sums(self.model, counters)
        model = self.model
        strategy = model.tower_strategy
        model.engine.build_for(self.source, with_targets=False)
        iterator = iter(self.source.distribute(strategy))
        if self._sum_function is None:

            def tower_sums(data):
                x, y, sample_weight = _compat.unpack_x_y_sample_weight(data)
                y_pred = model._call_tower(x, training=False)
                return [c._batch_sums(y, y_pred, sample_weight) for c in counters]

            def step(data):
                per_tower = model.run_on_towers(tower_sums, data)
                return tf.nest.map_structure(strategy.sum_over_towers, per_tower)

            # One trace for batches of any size: a process tracing again for
            # its short last batch would run another graph than the others,
            # whose collectives then never meet.
            signature = tf.nest.map_structure(_any_batch_size, iterator.element_spec)
            self._sum_function = tf.function(step, input_signature=[signature])
        totals = None
        while True:
            has_data, next_batches = strategy.next_step(iterator)
            if not bool(has_data):
                break
            sums = tf.nest.map_structure(np.float64, self._sum_function(next_batches()))
            totals = sums if totals is None else tf.nest.map_structure(np.add, totals, sums)
        if totals is None:
            raise ValueError("InferenceRunner: the validation source gave no batch.")
        return totals


def _tf_source(source, batch_size):
    from kerastower.inputs.sources import InputSource
    from kerastower.inputs.sources import as_input_source

    if isinstance(source, (tuple, list)) and not isinstance(source, InputSource):
        x, y, sample_weight = _compat.unpack_x_y_sample_weight(tuple(source))
        return as_input_source(x, y, sample_weight, batch_size)
    return as_input_source(source, batch_size=batch_size)


class _JaxSource:
    """What an InferenceRunner evaluates on JAX: `(x, y[, sample_weight])`
    arrays (`batch_size` per tower), or a PyDataset or re-iterable of batches."""

    def __init__(self, source, batch_size):
        if isinstance(source, (tuple, list)):
            self.x, self.y, self.sample_weight = _compat.unpack_x_y_sample_weight(tuple(source))
            self.batch_size = batch_size or 32
        else:
            self.x, self.y, self.sample_weight, self.batch_size = source, None, None, None

    def sums(self, model, counters):
        """Each counter's sums over the source: every step's towers predict
        their own batches (data-parallel, each example once), and the sums
        are taken over the step's examples, in float64 across steps."""
        batches = model.engine.input_source(self.x, self.y, self.sample_weight, self.batch_size,
                                            method="evaluate")
        model.engine.build_for(batches)
        totals = None
        for step in batches.one_pass(model.num_towers):
            y_pred = model.engine.run_towers("predict", step)   # the towers' outputs, in tower order
            _, y, sample_weight = (
                None if parts[0] is None else keras.tree.map_structure(lambda *a: np.concatenate(a), *parts)
                for parts in zip(*(_padded(batch) for batch in step)))
            sums = [{k: np.float64(v) for k, v in c._batch_sums(y, y_pred, sample_weight).items()}
                    for c in counters]
            totals = sums if totals is None else [
                {k: total[k] + part[k] for k in total} for total, part in zip(totals, sums)]
        if totals is None:
            raise ValueError("InferenceRunner: the validation source gave no batch.")
        return totals


def _padded(batch):
    """`(x, y, sample_weight)`, with None for what the batch does not hold."""
    return tuple(batch) + (None,) * (3 - len(batch))
