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

import keras

from kerastower import _compat
from kerastower.callbacks.base import Callback
from kerastower import backend

__all__ = ["InferenceRunner", "Inferencer", "ScalarStats", "ClassificationError"]


class Inferencer:
    """One kind of result an InferenceRunner computes over a source.

    Subclasses implement `_batch_sums(y, y_pred, sample_weight)`, returning a
    dict of scalar sums for one tower's batch, and `_results(sums)`, turning
    the sums over the whole source into the named results. `ScalarStats`
    instead asks the model's compiled metrics.

    Examples:
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
        # float64 for exact counts where the backend has it; in float32 (JAX,
        # whose x64 is off) exact up to 2**24 examples a batch, and the totals
        # add up in float64.
        exact = backend.exact_float()
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
        if isinstance(source, (tuple, list)):
            # Arrays: (x, y[, sample_weight]), `batch_size` examples a tower.
            x, y, sample_weight = _compat.unpack_x_y_sample_weight(tuple(source))
            self._data = {"x": x, "y": y, "sample_weight": sample_weight,
                          "batch_size": batch_size or 32}
        else:
            self._data = {"x": source, "batch_size": batch_size}
        # Made (and a bad source refused) now, not after an epoch of training.
        self._input = backend.evaluation_source(**{
            "y": None, "sample_weight": None, **self._data})
        self._compiled = {}  # what the engine compiled to sum over it
        self.inferencers = list(inferencers)
        for inferencer in self.inferencers:
            if not isinstance(inferencer, Inferencer):
                raise TypeError(
                    f"InferenceRunner takes kt.callbacks.Inferencer objects; got {inferencer!r}."
                )
        self.results = {}

    def _trigger(self):
        self.results = {}
        stats = [i for i in self.inferencers if isinstance(i, ScalarStats)]
        counters = [i for i in self.inferencers if not isinstance(i, ScalarStats)]
        if stats:
            with self.model.engine.training_metrics_kept():
                values = self.model.evaluate(**self._data, verbose=0, return_dict=True)
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

    def _sums_over_source(self, counters):
        """Per-inferencer sums over every example of the source, all towers
        (the engine's `inference_sums`)."""
        return self.model.engine.inference_sums(self._input, counters, self._compiled)
