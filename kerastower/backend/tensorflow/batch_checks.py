"""Whether a tower's batch fits the model: x against its inputs, y against
its outputs and compiled loss, by shape and dtype.

Keras reports such a mismatch deep inside a loss or a layer, without saying
which tower or step it was, and for some it says nothing at all: labels of
shape (B, 3) for a (B, 1) output with "mse" are broadcast, and training
goes on with a wrong loss. kerastower checks every batch spec before the
model is built (tower 0's) and every tower's batch while its step is
traced, and raises a `kt.errors.DataMismatchError` naming the tower, the
step, the shapes and dtypes seen and what to change, chained to Keras's own
error where Keras raised one. Errors that are not about the data pass
through unchanged.
"""

import contextlib

import keras

from kerastower._tf import tf
from kerastower import _compat
from kerastower.backend import building
from kerastower.errors import DataMismatchError
from kerastower.errors import KerasTowerError

__all__ = ["build_for", "checked_build", "checked_step", "computes_compiled_loss", "original_errors"]

# Losses that need y of the output's shape, and those that take class indices.
_SAME_SHAPE = {
    "MeanSquaredError": "mean_squared_error",
    "MeanAbsoluteError": "mean_absolute_error",
    "MeanAbsolutePercentageError": "mean_absolute_percentage_error",
    "MeanSquaredLogarithmicError": "mean_squared_logarithmic_error",
    "Huber": "huber",
    "LogCosh": "log_cosh",
    "CategoricalCrossentropy": "categorical_crossentropy",
    "CategoricalFocalCrossentropy": "categorical_focal_crossentropy",
    "KLDivergence": "kl_divergence",
    "Poisson": "poisson",
    "CosineSimilarity": "cosine_similarity",
    "CategoricalHinge": "categorical_hinge",
    "Hinge": "hinge",
    "SquaredHinge": "squared_hinge",
    "BinaryCrossentropy": "binary_crossentropy",
    "BinaryFocalCrossentropy": "binary_focal_crossentropy",
}
_SPARSE = {"SparseCategoricalCrossentropy": "sparse_categorical_crossentropy"}
_ONE_HOT = ("categorical_crossentropy", "categorical_focal_crossentropy")


def _loss_kind(loss):
    """("same" or "sparse", the loss's name) for a built-in Keras loss given
    as a name, function or instance; (None, None) for anything else."""
    if isinstance(loss, str):
        try:
            loss = keras.losses.get(loss)
        except (ValueError, TypeError):
            return None, None
    for kind, table in (("same", _SAME_SHAPE), ("sparse", _SPARSE)):
        for class_name, function_name in table.items():
            loss_class = getattr(keras.losses, class_name, None)
            function = getattr(keras.losses, function_name, None)
            if (loss_class is not None and type(loss) is loss_class) or (
                function is not None and loss is function
            ):
                return kind, function_name
    return None, None


def _dims(value):
    """The dims of a tensor, spec or KerasTensor (None where unknown), or
    None when its rank is unknown."""
    shape = tf.TensorShape(value.shape)
    return None if shape.rank is None else shape.as_list()


def _dtype(value):
    return tf.as_dtype(value.dtype)


def describe(value):
    """e.g. "float32 (None, 4)", for every leaf of a structure."""
    if value is None:
        return "none"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    dims = _dims(value)
    shape = "(unknown rank)" if dims is None else str(tuple(dims))
    return f"{_dtype(value).name} {shape}"


def _same_dims(a, b):
    """Whether dims `a` and `b` agree past the batch axis, after Keras drops
    a trailing 1 from the one of higher rank."""
    if len(a) == len(b) + 1 and a[-1] == 1:
        a = a[:-1]
    elif len(b) == len(a) + 1 and b[-1] == 1:
        b = b[:-1]
    return len(a) == len(b) and all(p is None or q is None or p == q for p, q in zip(a[1:], b[1:]))


def _model_inputs(model):
    """The model's declared inputs (functional models), or None."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    return list(inputs) if inputs else None


def _x_pairs(model, x):
    """[(name, x leaf, input)] where x's structure matches the inputs."""
    inputs = _model_inputs(model)
    if inputs is None or x is None:
        return []
    if isinstance(x, dict):
        by_name = {getattr(i, "name", None): i for i in inputs}
        return [(f"input {k!r}", v, by_name[k]) for k, v in x.items() if k in by_name]
    leaves = list(x) if isinstance(x, (list, tuple)) else [x]
    if len(leaves) != len(inputs):
        return []
    names = [f"input {n}" for n in range(len(inputs))] if len(inputs) > 1 else ["input"]
    return list(zip(names, leaves, inputs))


def _x_problems(model, x):
    problems = []
    for name, leaf, expected in _x_pairs(model, x):
        got, want = _dims(leaf), _dims(expected)
        text, wanted = _dtype(leaf) == tf.string, _dtype(expected) == tf.string
        if text != wanted:
            problems.append(
                f"x ({describe(leaf)}) holds {'strings' if text else 'numbers'}, but the model's "
                f"{name} takes {_dtype(expected).name}: "
                + ("convert x to numbers first, or start the model with keras.Input(dtype="
                   "\"string\") and a keras.layers.StringLookup or TextVectorization layer."
                   if text else "give x as strings, or change that Input's dtype.")
            )
        elif got is not None and want is not None and not _same_dims(got, want):
            problems.append(
                f"x ({describe(leaf)}) does not fit the model's {name} "
                f"({describe(expected)}): give examples of shape {tuple(want[1:])}, or build "
                f"the model with keras.Input(shape={tuple(got[1:])})."
            )
    return problems


def _targets(model, y, y_pred):
    """[(output name, y leaf, prediction, loss)] for the outputs whose y
    and loss kerastower can pair; [] when the structures do not say."""
    loss = getattr(model, "loss", None)
    if loss is None or y is None or y_pred is None:
        return []
    if not isinstance(y_pred, (dict, list, tuple)):
        if isinstance(y, (dict, list, tuple)):
            return []
        if isinstance(loss, (dict, list, tuple)):
            loss = list(loss.values() if isinstance(loss, dict) else loss)
            loss = loss[0] if len(loss) == 1 else None
        names = getattr(model, "output_names", None) or ["output"]
        return [(names[0], y, y_pred, loss)]
    names = list(getattr(model, "output_names", None) or [])
    if isinstance(y_pred, dict):
        predictions = dict(y_pred)
    elif len(names) == len(y_pred):
        predictions = dict(zip(names, y_pred))
    else:
        return []
    if isinstance(y, dict):
        labels = dict(y)
    elif isinstance(y, (list, tuple)) and len(y) == len(predictions):
        labels = dict(zip(predictions, y))
    else:
        return []
    if isinstance(loss, dict):
        losses = loss
    elif isinstance(loss, (list, tuple)):
        losses = dict(zip(predictions, loss)) if len(loss) == len(predictions) else {}
    else:
        losses = {name: loss for name in predictions}
    return [(name, labels[name], predictions[name], losses.get(name))
            for name in predictions if name in labels and labels[name] is not None]


def _y_problem(name, label, prediction, loss):
    kind, loss_name = _loss_kind(loss)
    if kind is None:
        return None
    got, out = _dims(label), _dims(prediction)
    seen = f"y ({describe(label)}) for output {name!r} ({describe(prediction)}) with {loss_name}"
    if _dtype(label) == tf.string:
        return (f"{seen}: the labels are strings, and the loss needs numbers. Map them to "
                "class indices first, e.g. `classes, y = np.unique(y, return_inverse=True)`.")
    if got is None or out is None or not got or not out:
        return None
    if kind == "sparse":
        labels = got[:-1] if len(got) == len(out) and got[-1] == 1 else got
        if len(labels) == len(out) - 1 and _same_dims(labels, out[:-1]):
            return None
        if len(got) == len(out) and _same_dims(got, out):
            return (f"{seen}: y looks one-hot, and {loss_name} takes one class index per "
                    "example. Use loss=\"categorical_crossentropy\", or pass "
                    "np.argmax(y, axis=-1).")
        return (f"{seen}: {loss_name} takes one class index per example, y of shape "
                f"{tuple(out[:-1])}. Reshape y, or use a loss that takes y of the output's shape.")
    if _same_dims(got, out):
        return None
    if loss_name in _ONE_HOT and len(got) == len(out) - 1 and _dtype(label).is_integer:
        return (f"{seen}: y looks like class indices, and {loss_name} takes one-hot labels of the "
                f"output's shape {tuple(out)}. Use loss=\"sparse_categorical_crossentropy\", or "
                f"one-hot encode y with keras.utils.to_categorical(y, {out[-1]}).")
    return (f"{seen}: {loss_name} needs y of the output's shape {tuple(out)} (Keras would "
            "broadcast these shapes, or fail, instead of comparing label to prediction). Reshape "
            f"y, or make the model's output {tuple(got[1:])}.")


def computes_compiled_loss(step_function):
    """Marks `step_function` as a tower step that computes the compiled loss
    on y (TowerModel's own train_step and test_step, backend/tensorflow/model.py):
    a model whose step is one has y checked against that loss."""
    step_function.computes_compiled_loss = True
    return step_function


def _uses_compiled_loss(model, step):
    """Whether the step computes the compiled loss on y (not an overridden
    compute_loss or step that may use y otherwise)."""
    if type(model).compute_loss is not keras.Model.compute_loss:
        return False
    return getattr(getattr(type(model), f"{step}_step"), "computes_compiled_loss", False)


def problems(model, step, x, y=None, y_pred=None):
    """What does not fit, one sentence each (with what to change)."""
    found = _x_problems(model, x)
    checks_y = step in ("train", "test") and y is not None and y_pred is not None
    if checks_y and _uses_compiled_loss(model, step):
        for target in _targets(model, y, y_pred):
            problem = _y_problem(*target)
            if problem:
                found.append(problem)
    return found


def _error(model, step, tower, found, x, y):
    where = f"tower {tower} of {model.num_towers}, {step} step (TowerModel.{step}_step)"
    return DataMismatchError(
        f"The batch of {where} does not fit the model: " + " ".join(found)
        + f" The batch seen: x {describe(x)}; y {describe(y)}."
    )


# A DataMismatchError raised while a tower step is traced leaves the
# tf.function rewritten by AutoGraph, and TensorFlow's traceback filter
# drops its cause; the original and its cause are kept in the model's
# engine's StepFailures (step_errors.py), and are what fit/evaluate raise.

class original_errors:
    """Around running step functions: an error leaving them that a tower's
    DataMismatchError caused (AutoGraph re-raises it as a StagingError, or
    as a copy without its cause) is replaced by that DataMismatchError,
    which has Keras's error as its cause. `failures`: the engine's
    StepFailures, where the towers' checks record them."""

    def __init__(self, failures):
        self.failures = failures

    def __enter__(self):
        self.failures.forget_batch_errors()
        return self

    def __exit__(self, kind, error, traceback):
        original, cause = self.failures.take_batch_error()
        if error is None or original is None:
            return False
        seen, link = set(), error
        while link is not None and id(link) not in seen:
            if link is original:
                original.__cause__ = cause
                original.__suppress_context__ = True
                raise original
            seen.add(id(link))
            link = link.__context__
        return False


def build_for(model, source, with_targets=True, step=None):
    """Builds `model` (layers, metrics, optimizer slots) from the spec of
    tower 0's batches of `source`, under its strategy, checking that the
    batches fit it (see `checked_build`)."""
    step = step or ("train" if with_targets else "predict")
    spec = source.element_spec(model.num_towers)
    building.mark_built_by_parts(model)
    with model.tower_strategy.scope(), checked_build(model, step, spec):
        if with_targets:
            _compat.symbolic_build(model, spec)
        elif not all(layer.built for layer in _compat.flatten_layers(model)):
            x, _, _ = _compat.unpack_x_y_sample_weight(spec)
            _compat.compute_output_spec(model._call_tower, _symbolic(x), training=False)
    model.engine.cache.local_weights = None


@contextlib.contextmanager
def checked_build(model, step, spec):
    """Around building the model from tower 0's batch spec: a Keras error
    there caused by a mismatch becomes a DataMismatchError; after the
    build, mismatches Keras lets pass (broadcast labels) raise too, with
    the error Keras's symbolic pass gives, if any, as the cause."""
    model.engine.failures.forget_batch_errors()
    x, y, _ = _compat.unpack_x_y_sample_weight(spec)
    try:
        yield
    except (ValueError, TypeError) as error:
        if isinstance(error, KerasTowerError):
            raise
        found = problems(model, step, x, y, _predictions(model, x, declared_only=False))
        if not found:
            raise
        raise _error(model, step, 0, found, x, y) from error
    found = problems(model, step, x, y, _predictions(model, x))
    if found:
        raise _error(model, step, 0, found, x, y) from _keras_error(model, step, x, y)


def _symbolic(spec):
    """KerasTensors standing for the tensors of a `tf.TensorSpec` structure."""
    return tf.nest.map_structure(lambda s: keras.KerasTensor(s.shape, s.dtype.name), spec)


def _predictions(model, x, declared_only=True):
    """The model's output specs, shaped like its predictions: a functional
    model's declared outputs, else (unless `declared_only`) a symbolic
    forward pass on `x`; None when neither gives them."""
    outputs = getattr(model, "outputs", None) if _model_inputs(model) else None
    if outputs:
        return outputs[0] if len(outputs) == 1 else dict(zip(model.output_names, outputs))
    if declared_only:
        return None
    try:
        return _compat.compute_output_spec(model._call_tower, _symbolic(x), training=False)
    except (ValueError, TypeError):
        return None


def _keras_error(model, step, x, y):
    """The error Keras's own symbolic pass over a batch spec raises (the
    forward pass, then the loss), or None where Keras lets it pass."""
    try:
        x = _symbolic(x)
        y_pred = _compat.compute_output_spec(model._call_tower, x, training=False)
        if y is not None and step != "predict":
            _compat.compute_output_spec(
                lambda a, b, c: _compat.compute_loss(model, x=a, y=b, y_pred=c, training=False),
                x, _symbolic(y), y_pred,
            )
    except (ValueError, TypeError) as error:
        return error
    return None


class checked_step:
    """Inside a tower's train or test step, around the forward pass, loss
    and metrics: a Keras error caused by a batch that does not fit the
    model becomes a DataMismatchError naming the tower, chained to it; a
    mismatch Keras let pass (broadcast labels) raises at the end of the
    block. Pass the predictions through `outputs(y_pred)`."""

    def __init__(self, model, step, x, y):
        from kerastower.tower import get_current_tower_context

        ctx = get_current_tower_context()
        self.model, self.step, self.x, self.y = model, step, x, y
        self.tower = 0 if ctx is None else ctx.index
        self.y_pred = None

    def outputs(self, y_pred):
        """Remembers the predictions for the check; returns them."""
        self.y_pred = y_pred
        return y_pred

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if error is not None and (
            not isinstance(error, (ValueError, TypeError)) or isinstance(error, KerasTowerError)
        ):
            return False
        found = problems(self.model, self.step, self.x, self.y, self.y_pred)
        if found:
            mismatch = _error(self.model, self.step, self.tower, found, self.x, self.y)
            self.model.engine.failures.record_batch_error(self.tower, mismatch, error)
            raise mismatch from error
        return False
