"""Every private Keras API the JAX engine uses, in one place.

As `kerastower/_compat.py` does for TensorFlow: each one is looked up when
needed, and a missing one raises a `KerasTowerError` naming it and the
installed versions, never a silent fallback. This module imports neither
TensorFlow nor `kerastower._compat`.

Keras 3 refuses `BatchNormalization(synchronized=True)` on JAX (its
constructor raises, and `keras.src.backend.jax.nn.moments` raises for
`synchronized=True`). `install_synchronized_batchnorm` lets the layer be
built and routes its moments to kerastower's, which reduce over the towers
(engine/jax_sync.py).
"""

import functools
import importlib
import inspect

import jax
import keras

from kerastower.errors import KerasTowerError

__all__ = ["TESTED", "require_function", "install_synchronized_batchnorm"]

TESTED = "Keras 3.15.1 with JAX 0.10.2 (Keras 3.10.0's source has the same hooks)"

_MOMENTS = ("keras.src.backend.jax.nn", "moments")
_BATCHNORM = ("keras.src.layers.normalization.batch_normalization", "BatchNormalization")


def _missing(what, error=None):
    detail = f" ({type(error).__name__}: {error})" if error is not None else ""
    return KerasTowerError(
        f"kerastower's JAX engine needs {what}, which this installation does not have"
        f"{detail}. Installed: Keras {keras.__version__}, JAX {jax.__version__}; "
        f"kerastower is tested with {TESTED}. Install a tested pair, e.g. "
        "pip install 'keras==3.15.*' 'jax==0.10.*'."
    )


def require_function(module_name, attribute):
    """`module_name.attribute`, or a KerasTowerError naming it and the versions."""
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise _missing(f"{module_name}.{attribute}", error) from None
    if not callable(found):
        raise _missing(f"{module_name}.{attribute} as a function or class")
    return found


def _parameter(function, name, what):
    parameters = inspect.signature(function).parameters
    if name not in parameters:
        raise _missing(f"{what} with a `{name}` argument")
    return parameters[name]


def _patched(owner, name, make_replacement):
    original = getattr(owner, name)
    if getattr(original, "_kerastower_original", None) is not None:
        return
    replacement = functools.update_wrapper(make_replacement(original), original)
    replacement._kerastower_original = original
    setattr(owner, name, replacement)


def install_synchronized_batchnorm(synchronized_moments):
    """Makes `BatchNormalization(synchronized=True)` work on JAX.

    The constructor is given `synchronized=False` for Keras's backend check
    and the layer then says `synchronized=True` (so `get_config` round-trips).
    Keras's JAX `moments(x, axes, keepdims, synchronized=True)` calls
    `synchronized_moments(x, axes, keepdims, local)`, `local` being Keras's
    own unsynchronized moments. Installs once; does nothing off JAX.
    """
    if keras.backend.backend() != "jax":
        return
    module = importlib.import_module(_MOMENTS[0])
    moments = require_function(*_MOMENTS)
    _parameter(moments, "synchronized", ".".join(_MOMENTS))
    batchnorm = require_function(*_BATCHNORM)
    _parameter(batchnorm.__init__, "synchronized", "BatchNormalization.__init__")

    def routed(original):
        def moments(x, axes, keepdims=False, synchronized=False):
            if not synchronized:
                return original(x, axes, keepdims, synchronized=False)
            return synchronized_moments(x, axes, keepdims, functools.partial(original, synchronized=False))
        return moments

    def accepting_synchronized(original):
        signature = inspect.signature(original)

        def __init__(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            synchronized = bool(bound.arguments.get("synchronized", False))
            bound.arguments["synchronized"] = False
            original(*bound.args, **bound.kwargs)
            self.synchronized = synchronized

        # Keras reads the constructor's arguments for get_config
        # (inspect.getfullargspec, which does not follow __wrapped__).
        __init__.__signature__ = signature
        return __init__

    _patched(module, _MOMENTS[1], routed)
    _patched(batchnorm, "__init__", accepting_synchronized)
