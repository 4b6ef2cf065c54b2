"""How a checkpoint stores its variables: `variables.npz`, on every backend.

Every variable is stored under its key (kerastower/checkpoint/keys.py) in
`variables.npz` (`np.savez`, uncompressed; read by `np.load`), on
TensorFlow as on JAX, so that a checkpoint written on one backend is read
on the other, and reading one never imports TensorFlow (a JAX-only install
has none). kerastower/checkpoint/store.py does the rest (state, manifest,
verification, key matching, integer casts) the same way for both.

kerastower before this format wrote TensorFlow's own on TensorFlow:
`variables.index` and `variables.data-*`, by `tf.raw_ops.SaveV2`. A folder
holding those is still read, with `tf.train.load_checkpoint`, where
TensorFlow can be imported; where it cannot, `read` raises
`TensorFlowFormatError` saying so.

Manifests name dtypes by Keras's standard names
(`keras.backend.standardize_dtype`: "float32", "int64", "uint32",
"bfloat16", ...), on both backends; they are TensorFlow's names too, which
older manifests hold, so those still verify and match.
"""

import importlib
import os
import zipfile

import keras
import numpy as np

from kerastower._tf import tf
from kerastower._tf import tf_loaded
from kerastower.errors import KerasTowerError

__all__ = [
    "host_value", "dtype_name", "is_floating", "is_integer", "write", "read",
    "TensorFlowFormatError",
]

PREFIX = "variables"
NUMPY_FILE = PREFIX + ".npz"
TENSORFLOW_INDEX = PREFIX + ".index"  # the format older versions wrote on TensorFlow
INTEGER_DTYPES = frozenset(
    ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
)


class TensorFlowFormatError(KerasTowerError):
    """A checkpoint in TensorFlow's format (`variables.index`), written by an
    older kerastower, where TensorFlow cannot be imported to read it. The
    checkpoint is intact: AutoResume stops rather than skip it for an
    older one."""

    def __init__(self, path, error):
        super().__init__(
            f"The checkpoint {path} holds its variables in TensorFlow's format "
            f"({TENSORFLOW_INDEX}, variables.data-*), as an older kerastower wrote them on "
            f"TensorFlow, and TensorFlow is needed to read it, but importing it failed "
            f"({type(error).__name__}: {error}). Install TensorFlow (pip install "
            f"tensorflow) to resume from it; once resumed, the next checkpoint is written "
            f"as {NUMPY_FILE}, which every backend reads without TensorFlow."
        )
        self.path = path


def host_value(variable):
    """The value of a (possibly mirrored) variable, as a numpy array."""
    value = variable.value
    if tf_loaded() and isinstance(value, (tf.Variable, tf.Tensor)):  # a mirrored one too
        return tf.convert_to_tensor(value).numpy()
    return np.asarray(keras.ops.convert_to_numpy(value))


def dtype_name(dtype):
    """The name of `dtype` in a manifest, the same on every backend: Keras's
    standard name, which is TensorFlow's too ("float32", "int64", "bfloat16")."""
    return keras.backend.standardize_dtype(dtype)


def is_floating(dtype):
    """Whether values of `dtype` can be NaN or Inf."""
    return keras.backend.is_float_dtype(dtype_name(dtype))


def is_integer(name):
    """Whether the manifest dtype name `name` is a (signed or unsigned) integer dtype."""
    return name in INTEGER_DTYPES


def write(folder, keys, values):
    """Writes `values` (numpy arrays) under `keys` into `folder`, as `variables.npz`."""
    with open(os.path.join(folder, NUMPY_FILE), "wb") as f:
        np.savez(f, **dict(zip(keys, values)))


def _numpy_dtype(name):
    try:
        return np.dtype(name)
    except TypeError:  # bfloat16, float8_*: numpy knows them through ml_dtypes
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))


def _typed(value, name):
    """`value` as loaded from an npz file, of the manifest's dtype `name`:
    numpy stores dtypes it does not know (bfloat16, float8_*) as raw bytes."""
    if value.dtype.kind == "V" and name is not None:
        return value.view(_numpy_dtype(name))
    return value


def _read_tensorflow_format(path, keys):
    try:
        tensorflow = importlib.import_module("tensorflow")
    except ImportError as error:
        raise TensorFlowFormatError(path, error) from None
    try:
        reader = tensorflow.train.load_checkpoint(os.path.join(path, PREFIX))
        return [reader.get_tensor(key) for key in keys]
    except tensorflow.errors.OpError as error:
        raise ValueError(str(error)) from None


def read(path, keys, dtypes=None):
    """The values stored under `keys` in the checkpoint folder `path`, as
    numpy arrays; `dtypes`, the manifest's dtype names of those keys, types
    the values that numpy stores as raw bytes (bfloat16).

    Reads `variables.npz`, or TensorFlow's format (`variables.index`) as
    older versions wrote it on TensorFlow. Raises ValueError (or OSError)
    naming what cannot be read, and TensorFlowFormatError for TensorFlow's
    format where TensorFlow cannot be imported."""
    file = os.path.join(path, NUMPY_FILE)
    if not os.path.isfile(file) and os.path.isfile(os.path.join(path, TENSORFLOW_INDEX)):
        return _read_tensorflow_format(path, keys)
    names = list(dtypes) if dtypes is not None else [None] * len(keys)
    try:
        with np.load(file, allow_pickle=False) as stored:
            return [_typed(stored[key], name) for key, name in zip(keys, names)]
    except (KeyError, EOFError, zipfile.BadZipFile) as error:
        raise ValueError(f"{NUMPY_FILE}: {type(error).__name__}: {error}") from None
