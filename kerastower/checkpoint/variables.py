"""How a checkpoint stores its variables: TensorFlow's files, or numpy's.

On TensorFlow, `variables.index` and `variables.data-*` (written by
`tf.raw_ops.SaveV2`, read by `tf.train.load_checkpoint`); on any other
Keras backend (JAX), `variables.npz` (`np.savez`, read by `np.load`), so
that checkpoints never import TensorFlow there. Both hold every variable
under its key (kerastower/checkpoint/keys.py). A checkpoint is read in the
format of the files it holds; kerastower/checkpoint/store.py does the rest
(state, manifest, verification, key matching) the same way for both.
"""

import os
import zipfile

import keras
import numpy as np

from kerastower._tf import tf

__all__ = ["on_tensorflow", "host_value", "dtype_name", "is_floating", "write", "read"]

PREFIX = "variables"
NUMPY_FILE = PREFIX + ".npz"


def on_tensorflow():
    """Whether checkpoints are written in TensorFlow's format (Keras runs on it)."""
    return keras.backend.backend() == "tensorflow"


def host_value(variable):
    """The value of a (possibly mirrored) variable, as a numpy array."""
    if on_tensorflow():
        return tf.convert_to_tensor(variable.value).numpy()
    return np.asarray(keras.ops.convert_to_numpy(variable.value))


def dtype_name(dtype):
    """The name of `dtype` in a manifest: TensorFlow's, or Keras's off it."""
    if on_tensorflow():
        return tf.as_dtype(dtype).name
    return keras.backend.standardize_dtype(dtype)


def is_floating(dtype):
    """Whether values of `dtype` can be NaN or Inf."""
    if on_tensorflow():
        return tf.as_dtype(dtype).is_floating
    return keras.backend.is_float_dtype(keras.backend.standardize_dtype(dtype))


def write(folder, keys, values):
    """Writes `values` (numpy arrays) under `keys` into `folder`."""
    if on_tensorflow():
        with tf.device("CPU:0"):
            tf.raw_ops.SaveV2(
                prefix=os.path.join(folder, PREFIX),
                tensor_names=list(keys),
                shape_and_slices=[""] * len(keys),
                tensors=list(values),
            )
        return
    with open(os.path.join(folder, NUMPY_FILE), "wb") as f:
        np.savez(f, **dict(zip(keys, values)))


def read(path, keys):
    """The values stored under `keys` in the checkpoint folder `path`.

    Read in the format of the files the folder holds; raises ValueError (or
    OSError) naming what cannot be read."""
    file = os.path.join(path, NUMPY_FILE)
    if os.path.isfile(file):
        try:
            with np.load(file, allow_pickle=False) as stored:
                return [stored[key] for key in keys]
        except (KeyError, EOFError, zipfile.BadZipFile) as error:
            raise ValueError(f"{NUMPY_FILE}: {type(error).__name__}: {error}") from None
    try:
        reader = tf.train.load_checkpoint(os.path.join(path, PREFIX))
        return [reader.get_tensor(key) for key in keys]
    except tf.errors.OpError as error:
        raise ValueError(str(error)) from None
