"""Which kind of input fit, evaluate and predict received: chosen here, once, for both backends.

Every input `fit(x, y, ...)`, `evaluate`, `predict`, `validation_data` and
`kt.Trainer` take is one of the kinds below. `choose` decides the kind and
checks the arguments that go with it; which batch each tower then takes of
it is decided in inputs/ too, the same on both backends:

| kind           | what it is                                   | tower k of step s takes          |
|----------------|----------------------------------------------|----------------------------------|
| `input_source` | a `kt.InputSource` (TensorFlow)              | what the source gives tower k    |
| `dataset`      | a `tf.data.Dataset`, batched per tower       | the dataset's batch s*N+k        |
| `arrays`       | numpy arrays (lists and dicts of them),      | rows of batch s*N+k of the pass  |
|                | tensors, ragged and sparse arrays            | (array_rows.py)                  |
| `batches`      | a Python generator, iterator or iterable of  | the source's batch s*N+k         |
|                | batches, a `keras.utils.PyDataset`, a torch  | (dealing.py)                     |
|                | `DataLoader`                                 |                                  |

Each engine only places what was chosen on its devices: TensorFlow in
backend/tensorflow/inputs.py, JAX in backend/jax/inputs.py. A new kind of
input is one `register_input_kind` call, which says how it reads as one of
these; both backends then take it.

Examples:
    >>> from kerastower.inputs.chooser import choose
    >>> choose(np.ones((4, 2)), np.zeros(4), batch_size=2).kind
    'arrays'
    >>> choose(iter([(np.ones((2, 2)), np.zeros(2))])).kind
    'batches'
"""

import collections
import dataclasses

import numpy as np

from kerastower._tf import tf
from kerastower._tf import tf_loaded
from kerastower.arguments import integer
from kerastower.errors import InputSourceError
from kerastower.inputs import python_sources
from kerastower.inputs import ragged_sparse
from kerastower.inputs.sources import InputSource

__all__ = ["InputChoice", "KINDS", "choose", "forget_input_kind", "kind_of", "register_input_kind"]

KINDS = ("input_source", "dataset", "arrays", "batches")

# A registered kind: how to recognise it, and how it reads as a built-in one.
InputKind = collections.namedtuple("InputKind", ["name", "matches", "convert"])

# Kinds registered with `register_input_kind`, tried before the built-in ones.
_REGISTERED = {}


@dataclasses.dataclass(frozen=True)
class InputChoice:
    """What an input was chosen to be: its kind (one of `KINDS`), what the
    towers read (`x`, `y`, `sample_weight`), the per-tower `batch_size` of
    arrays (None for the kinds batched already), how it is reshuffled
    every pass (`shuffle`: False, True or "batch", as Keras takes it), and
    the registered kind it was read from, if any."""

    kind: str
    x: object
    y: object = None
    sample_weight: object = None
    batch_size: object = None
    shuffle: object = False
    registered: object = None


def register_input_kind(name, matches, convert):
    """Teaches fit, evaluate, predict and kt.Trainer a new kind of input, on both backends.

    `matches(x)` says whether `x` is of the kind; `convert(x, y,
    sample_weight)` returns `(x, y, sample_weight)` of a kind kerastower
    takes already: numpy arrays, or a Python iterable of batches (each
    batch one tower's). A registered kind reads only what no built-in kind
    takes; kinds registered later are tried first, and registering a name
    again replaces it.

    Examples:
        >>> class Table:  # columns by name, the label among them
        ...     def __init__(self, columns):
        ...         self.columns = columns
        >>> kt.register_input_kind(
        ...     "table", lambda x: isinstance(x, Table),
        ...     lambda x, y, w: (np.stack([x.columns["a"], x.columns["b"]], 1), x.columns["label"], w))
        >>> from kerastower.inputs.chooser import choose
        >>> choice = choose(Table({"a": np.zeros(4), "b": np.ones(4), "label": np.zeros(4)}), batch_size=2)
        >>> choice.kind, choice.registered, choice.x.shape
        ('arrays', 'table', (4, 2))
        >>> from kerastower.inputs.chooser import forget_input_kind
        >>> forget_input_kind("table")
    """
    if not isinstance(name, str) or not name or name in KINDS:
        raise InputSourceError(
            f"register_input_kind: name must be a new non-empty str, not one of the built-in "
            f"kinds {KINDS}; got {name!r}.")
    for role, function in (("matches", matches), ("convert", convert)):
        if not callable(function):
            raise InputSourceError(
                f"register_input_kind({name!r}): {role} must be callable; got "
                f"{type(function).__name__}.")
    _REGISTERED.pop(name, None)
    _REGISTERED[name] = InputKind(name, matches, convert)


def forget_input_kind(name):
    """Forgets the input kind registered as `name` (a test's, an example's)."""
    _REGISTERED.pop(name, None)


def _is_tf_value(value, *names):
    """Whether `value` is one of TensorFlow's types `names` (never, TensorFlow not imported)."""
    return tf_loaded() and isinstance(value, tuple(_tf_type(n) for n in names))


def _tf_type(dotted):
    found = tf
    for part in dotted.split("."):
        found = getattr(found, part)
    return found


def _is_array(value):
    """An array or a list, tuple or dict of them (Keras's array adapter's inputs)."""
    if isinstance(value, np.ndarray) or ragged_sparse.is_sparse(value) or _is_tf_value(
            value, "Tensor", "RaggedTensor", "SparseTensor"):
        return True
    if isinstance(value, dict):
        return bool(value) and all(_is_array(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_is_array(v) for v in value)
    return hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "__array__")


def _batched_already(x, kind, y, sample_weight, batch_size):
    """A source that makes its own batches takes no y, sample_weight or batch_size."""
    what = type(x).__name__
    if y is not None or sample_weight is not None:
        raise InputSourceError(
            f"y and sample_weight must be None when x is a {what}: it yields "
            "(x, y, sample_weight) itself.")
    if batch_size is not None and kind == "batches":
        raise InputSourceError(
            f"batch_size={batch_size} was given with a {what}, whose batches are made "
            "already: each tower takes whole batches of the source. Leave batch_size unset.")
    if batch_size is not None:
        raise InputSourceError(
            f"batch_size={batch_size} was given with a {what}, which is batched already: "
            "batch the pipeline with the per-tower batch size and leave batch_size unset.")
    return InputChoice(kind, x)


def _built_in_kind(x):
    """The built-in kind of `x`, or None."""
    if isinstance(x, InputSource):
        return "input_source"
    if _is_tf_value(x, "data.Dataset"):
        return "dataset"
    if _is_tf_value(x, "distribute.DistributedDataset") or (
            tf_loaded() and hasattr(x, "_input_workers")):
        raise InputSourceError(
            "Pass the tf.data.Dataset itself, or kt.DatasetInput(fn), not a "
            "distributed dataset: kerastower distributes it so that each tower "
            "takes whole batches of its own.")
    if _is_array(x):
        return "arrays"
    if python_sources.is_batched(x):
        return "batches"
    return None


def _checked(kind, x, y, sample_weight, batch_size, shuffle):
    """The choice of `x` of `kind`, with the arguments that go with it checked."""
    if kind != "arrays":
        choice = _batched_already(x, kind, y, sample_weight, batch_size)
        return dataclasses.replace(choice, shuffle=shuffle) if kind == "batches" else choice
    batch_size = 32 if batch_size is None else integer(
        batch_size, "batch_size (per tower)", "kerastower", minimum=1)
    if y is None and sample_weight is not None:
        raise InputSourceError(
            "sample_weight was given without y; kerastower needs targets to "
            "weight. Pass y, or put the weights into the loss yourself.")
    return InputChoice("arrays", x, y, sample_weight, batch_size, shuffle)


def choose(x, y=None, sample_weight=None, batch_size=None, shuffle=False):
    """The `InputChoice` for what fit, evaluate or predict received.

    `batch_size` is the per-tower batch of arrays (default 32); the kinds
    that are batched already take none, nor `y` or `sample_weight`. The
    built-in kinds are recognised first; a registered kind reads what none
    of them takes, the latest registered first.
    """
    kind = _built_in_kind(x)
    if kind is not None:
        return _checked(kind, x, y, sample_weight, batch_size, shuffle)
    for registered in reversed(list(_REGISTERED.values())):
        if registered.matches(x):
            x, y, sample_weight = registered.convert(x, y, sample_weight)
            kind = _built_in_kind(x)
            if kind is None:
                raise InputSourceError(
                    f"The input kind {registered.name!r} converted its input into a "
                    f"{type(x).__name__}, which kerastower does not take: its convert(x, y, "
                    "sample_weight) must return numpy arrays or a Python source of batches.")
            choice = _checked(kind, x, y, sample_weight, batch_size, shuffle)
            return dataclasses.replace(choice, registered=registered.name)
    registered = f" (registered: {', '.join(_REGISTERED)})" if _REGISTERED else ""
    raise InputSourceError(
        "fit/evaluate/predict take a kt.InputSource, a tf.data.Dataset, numpy "
        "arrays (or lists and dicts of them), a Python generator or iterable of "
        "batches, a keras.utils.PyDataset, or a kind registered with "
        f"kt.register_input_kind{registered}; got x of type {type(x).__name__}.")


def kind_of(x):
    """The kind `choose` would find for `x`, or None for what it refuses, without checks."""
    try:
        return choose(x).kind
    except InputSourceError:
        return None
