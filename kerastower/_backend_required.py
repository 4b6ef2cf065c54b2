"""Checks, before Keras is imported, that the backend Keras will pick is installed.

kerastower depends on neither TensorFlow nor JAX: `pip install
"kerastower[tensorflow]"` or `"kerastower[jax]"` brings one. Keras picks its
backend when it is first imported (KERAS_BACKEND, else keras.json, else
TensorFlow) and, when that backend is missing, fails with a bare
`ModuleNotFoundError: No module named 'tensorflow'` from deep inside its
own import, which says nothing of the extras or of KERAS_BACKEND. So
`kerastower/__init__.py` calls `check_backend_installed()` first: it reads
the backend the way Keras 3 does (keras/src/backend/config.py) without
importing Keras, TensorFlow or JAX, and raises `BackendNotInstalledError`
naming the extra to install. Backends kerastower does not run on (torch,
numpy, openvino) are left to Keras.
"""

import importlib.util
import json
import os
import sys

__all__ = ["BackendNotInstalledError", "check_backend_installed", "keras_backend_choice",
           "running_backend"]

# Keras's backend name -> (module Keras imports for it, its name in words, kerastower's extra).
_SUPPORTED = {
    "tensorflow": ("tensorflow", "TensorFlow", "tensorflow"),
    "jax": ("jax", "JAX", "jax"),
}


def running_backend():
    """The backend Keras runs on, by Keras's name ("tensorflow", "jax").

    The one helper through which kerastower asks which backend runs:
    `kerastower.backend.name()` is this, and the few modules outside
    `kerastower/backend/` that must ask call it.

    Examples:
        >>> from kerastower._backend_required import running_backend
        >>> running_backend() == keras.backend.backend()
        True
    """
    import keras

    return keras.backend.backend()


class BackendNotInstalledError(ImportError):
    """The backend Keras will run on is not installed; the message names the
    `pip install "kerastower[...]"` that brings it."""


def _keras_json_path():
    """keras.json's path as Keras 3 computes it: $KERAS_HOME (whenever the
    variable is set, even empty), else ~/.keras, or /tmp/.keras when the home
    directory is not writable."""
    if "KERAS_HOME" in os.environ:
        keras_dir = os.environ.get("KERAS_HOME")
    else:
        base = os.path.expanduser("~")
        if not os.access(base, os.W_OK):
            base = "/tmp"
        keras_dir = os.path.join(base, ".keras")
    return os.path.expanduser(os.path.join(keras_dir, "keras.json"))


def _imported_keras_backend():
    """The backend of a Keras imported already (read, nothing imported), or None."""
    config = getattr(sys.modules.get("keras"), "config", None)
    backend = getattr(config, "backend", None)
    return backend() if callable(backend) else None


def keras_backend_choice():
    """The backend Keras will use, and why, as `(name, reason)`.

    Keras's own rules, in its order: a non-empty KERAS_BACKEND wins; else the
    "backend" key of keras.json when the file exists (an unreadable JSON file
    counts as empty); else "tensorflow". When Keras is already imported, its
    choice is read from it (without importing anything).
    """
    imported = _imported_keras_backend()
    if imported is not None:
        return imported, "Keras, imported before kerastower, chose it"
    env = os.environ.get("KERAS_BACKEND")
    if env:
        return env, f"KERAS_BACKEND={env}"
    path = _keras_json_path()
    name, reason = "tensorflow", None
    if os.path.exists(path):
        try:
            with open(path) as f:
                config = json.load(f)
        except ValueError:
            config = {}
        except OSError:
            config = None  # Keras will raise on its own
        if isinstance(config, dict) and "backend" in config:
            name, reason = config["backend"], f'{path} says "backend": "{config["backend"]}"'
    if reason is None:
        reason = "KERAS_BACKEND is unset and no keras.json names a backend, so Keras defaults to TensorFlow"
        if env == "":
            reason = "KERAS_BACKEND is empty and no keras.json names a backend, so Keras defaults to TensorFlow"
    return name, reason


def _installed(module):
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules without a __spec__: it is there
        return True


def check_backend_installed():
    """Raises `BackendNotInstalledError` when Keras will run on TensorFlow or
    JAX and that package cannot be found; does nothing otherwise (other
    backends are Keras's business). Imports neither Keras nor a backend.

    Examples:
        >>> from kerastower._backend_required import check_backend_installed
        >>> check_backend_installed()   # the installed backend: nothing happens
    """
    name, reason = keras_backend_choice()
    if name not in _SUPPORTED:
        return
    module, words, extra = _SUPPORTED[name]
    if _installed(module):
        return
    other = "jax" if name == "tensorflow" else "tensorflow"
    other_module, other_words, other_extra = _SUPPORTED[other]
    raise BackendNotInstalledError(
        f"kerastower: Keras will run on {words} ({reason}), but {words} is not "
        f"installed. Install it with `pip install \"kerastower[{extra}]\"` "
        f"(from a clone: `pip install -e \".[{extra}]\"`), or run on {other_words}: "
        f"`pip install \"kerastower[{other_extra}]\"` and set KERAS_BACKEND={other}.",
        name=module,
    )
