"""A task's preprocessing, applied to every tower's raw batch as KerasHub applies it.

A KerasHub task (`kt.TowerModel(task)`, a `TaskTowerModel`) takes raw
inputs, strings or images, and preprocesses them in its `fit`, `evaluate`
and `predict`: KerasHub batches the raw examples in a `tf.data` pipeline,
in order, and maps the task's `preprocess_samples` (its preprocessor) over
the batches. kerastower does the same before it hands the batches out, so

- each tower's batch is one batch of that pipeline: tower k of a step
  takes the k-th next raw batch, preprocessed whole, exactly as stock
  KerasHub preprocesses its batch (1 tower takes stock's batches; N towers
  x B take the joined N*B examples, preprocessed B at a time);
- arrays (numpy arrays of strings or images, lists of strings, tuples and
  dicts of them) are batched by `batch_size` per tower and read in order,
  not shuffled: KerasHub reads them so (shuffle a `tf.data` pipeline to
  shuffle); with `steps_per_epoch` they repeat;
- a `tf.data.Dataset` of raw batches is mapped as it is;
- on both backends the preprocessing runs in tf.data (KerasHub's
  preprocessing layers are TensorFlow ops on every backend), and the JAX
  engine reads the pipeline's batches as numpy, as Keras does.

Sources that are not raw examples KerasHub could map (Python generators,
PyDatasets, a `kt.InputSource`) raise `kt.InputSourceError`. The engines
call `preprocessed` first thing in `input_source` and `validation_source`,
and `ready` on the sources they make of its pipelines, so that fit's
validation source, read again by `evaluate`, is not preprocessed twice.

```python
x, y, sample_weight, batch_size = preprocessed(model, x, y, sample_weight, batch_size)
```
"""


import numpy as np

from kerastower.arguments import integer
from kerastower.errors import InputSourceError
from kerastower.inputs.python_sources import is_batched

__all__ = ["preprocesses", "preprocessed", "preprocessed_validation", "ready"]

def preprocesses(model):
    """Whether `model` preprocesses its raw inputs: it has a preprocessor
    and KerasHub's `preprocess_samples` (a KerasHub task in a TaskTowerModel).

    >>> from kerastower.inputs.preprocessing import preprocesses
    >>> preprocesses(keras.Sequential([keras.layers.Dense(1)]))
    False
    """
    return (getattr(model, "preprocessor", None) is not None
            and callable(getattr(model, "preprocess_samples", None)))


def ready(source):
    """Marks `source`, made of a pipeline `preprocessed` gave, as preprocessed; returns it.

    >>> from kerastower.inputs.preprocessing import ready
    >>> class Source:
    ...     pass
    >>> source = Source()
    >>> ready(source) is source
    True
    """
    # Fit's validation source comes back through `evaluate`, already preprocessed.
    source.preprocessed_by_task = True
    return source


def preprocessed(model, x, y=None, sample_weight=None, batch_size=None, repeat=False):
    """`(x, y, sample_weight, batch_size)` as the source maker should read them:
    for a model that `preprocesses`, a `tf.data.Dataset` of preprocessed
    per-tower batches (and None, None, None); else unchanged.

    Arrays are batched by `batch_size` (per tower, 32 unless given), in
    order, endless with `repeat`; a `tf.data.Dataset` is mapped as it is.

    Examples:
        >>> from kerastower.inputs.preprocessing import preprocessed
        >>> class Doubling(keras.Model):
        ...     preprocessor = "doubles x"
        ...     def preprocess_samples(self, x, y=None, sample_weight=None):
        ...         return keras.utils.pack_x_y_sample_weight(2 * x, y, sample_weight)
        >>> x, y, _, batch_size = preprocessed(Doubling(), np.ones((6, 1)), np.zeros(6), batch_size=4)
        >>> [b[0][:, 0].numpy().tolist() for b in x], y, batch_size
        ([[2.0, 2.0, 2.0, 2.0], [2.0, 2.0]], None, None)
    """
    if not preprocesses(model) or _is_ready(x):
        return x, y, sample_weight, batch_size
    tf = _tensorflow(model)
    if isinstance(x, tf.data.Dataset):
        dataset = x  # y, sample_weight and batch_size must be None: the source maker says so
    else:
        _check_raw_arrays(model, x)
        dataset = _batched(tf, x, y, sample_weight, batch_size, repeat)
        y = sample_weight = batch_size = None
    # In order: tower k of a step takes the k-th next batch.
    dataset = dataset.map(model.preprocess_samples, num_parallel_calls=tf.data.AUTOTUNE,
                          deterministic=True)
    return dataset.prefetch(tf.data.AUTOTUNE), y, sample_weight, batch_size


def preprocessed_validation(model, validation_data, batch_size):
    """fit's `validation_data` for a model that `preprocesses`: a dataset
    of preprocessed batches (`batch_size` examples each, for arrays), as
    KerasHub preprocesses it; unchanged for any other model.

    >>> from kerastower.inputs.preprocessing import preprocessed_validation
    >>> preprocessed_validation(keras.Sequential(), ("x", "y"), 8)
    ('x', 'y')
    """
    if not preprocesses(model) or _is_ready(validation_data):
        return validation_data
    if isinstance(validation_data, (tuple, list)) and not _is_dataset(validation_data[0]):
        data = tuple(validation_data) + (None,) * (3 - len(validation_data))
        if len(validation_data) > 3:
            raise InputSourceError(
                f"validation_data is (x, y) or (x, y, sample_weight); got a tuple of "
                f"{len(validation_data)} elements.")
        return preprocessed(model, data[0], data[1], data[2], batch_size)[0]
    return preprocessed(model, validation_data)[0]


def _is_ready(x):
    return getattr(x, "preprocessed_by_task", False) is True


def _is_dataset(x):
    return hasattr(x, "element_spec") and hasattr(x, "map") and hasattr(x, "cardinality")


def _tensorflow(model):
    try:
        import tensorflow as tf
    except ImportError as error:
        raise InputSourceError(
            f"{model.name} preprocesses its inputs with its preprocessor, which KerasHub runs "
            "in tf.data on every backend, but TensorFlow is not installed. Install it "
            "(pip install tensorflow-cpu), or set model.preprocessor = None and feed the "
            "model's own inputs.") from error
    return tf


def _leaves(x):
    """The arrays of `x`. As in `tf.data.Dataset.from_tensor_slices`, tuples
    and dicts are structure and a list is one array (a list of strings)."""
    if isinstance(x, tuple):
        return [leaf for item in x for leaf in _leaves(item)]
    if isinstance(x, dict):
        return [leaf for item in x.values() for leaf in _leaves(item)]
    return [x]


def _shape(leaf):
    """A leaf's shape; a tensor's (ragged ones too) without converting it."""
    shape = getattr(leaf, "shape", None)
    return tuple(shape) if shape is not None else np.shape(leaf)


def _check_raw_arrays(model, x):
    what = None
    if x is None:
        what = "no x"
    elif is_batched(x) or type(x).__module__.startswith("kerastower") or hasattr(x, "tower_dataset"):
        what = f"a {type(x).__name__}"
    if what is not None:
        raise InputSourceError(
            f"{model.name} preprocesses each tower's raw batch with its preprocessor "
            f"({type(model.preprocessor).__name__}), as KerasHub's fit does: it takes "
            "numpy arrays (or lists, tuples and dicts of them) or a tf.data.Dataset of raw "
            f"examples, and got {what}. Give the raw examples as a tf.data.Dataset "
            "(tf.data.Dataset.from_generator for a generator), or preprocess them yourself "
            "and set model.preprocessor = None.")


def _batched(tf, x, y, sample_weight, batch_size, repeat):
    """The raw examples, in order, in batches of `batch_size` (32 unless
    given), as KerasHub batches arrays: `x`, `(x,)` for a tuple `x` (read
    as inputs, not as x and y), else `(x, y)` or `(x, y, sample_weight)`."""
    if y is None and sample_weight is None:
        element = (x,) if isinstance(x, tuple) else x
    else:
        element = tuple(a for a in (x, y, sample_weight) if a is not None)
    shapes = [_shape(leaf) for leaf in _leaves(element)]
    if any(not shape for shape in shapes):
        raise InputSourceError(
            "x, y and sample_weight must hold a batch of examples (a first, batch "
            "dimension); got a single one. Wrap a single example in a list, e.g. [text].")
    lengths = sorted({int(shape[0]) for shape in shapes})
    if len(lengths) > 1:
        raise InputSourceError(
            f"x, y and sample_weight must have the same number of examples; got {lengths}.")
    element = _as_tensors(element)
    batch_size = 32 if batch_size is None else integer(
        batch_size, "batch_size (per tower)", "kerastower", minimum=1)
    dataset = tf.data.Dataset.from_tensor_slices(element).batch(batch_size)
    return dataset.repeat() if repeat else dataset


def _as_tensors(element):
    """Leaves tf.data takes as they are (numpy arrays, lists, tf tensors)
    kept; other arrays (JAX's, torch's) as numpy."""
    if isinstance(element, tuple):
        return tuple(_as_tensors(item) for item in element)
    if isinstance(element, dict):
        return {key: _as_tensors(item) for key, item in element.items()}
    if isinstance(element, (np.ndarray, list)) or type(element).__module__.startswith("tensorflow"):
        return element
    return np.asarray(element) if hasattr(element, "__array__") else element
