"""The private Keras APIs of the JAX engine (see the package's docstring).

A `keras.StatelessScope` opened inside another does not read the outer
one's values (a variable it does not map reads its stored value), so a
step that differentiates inside a tower function would see stale weights;
`inheriting_stateless_scope` starts from the outer scope's mapping.

Keras 3 refuses `BatchNormalization(synchronized=True)` on JAX (its
constructor raises, and `keras.src.backend.jax.nn.moments` raises for
`synchronized=True`). `install_synchronized_batchnorm` lets the layer be
built and routes its moments to kerastower's, which reduce over the towers
(backend/jax/sync.py).
"""

import functools
import importlib
import inspect

import keras

from kerastower._compat.patches import _patch
from kerastower._compat.required import _missing
from kerastower._compat.required import require

__all__ = ["require_function", "install_synchronized_batchnorm", "current_stateless_scope",
           "inheriting_stateless_scope"]

_MOMENTS = ("keras.src.backend.jax.nn", "moments")
_STATELESS_SCOPE = ("keras.src.backend.common.stateless_scope", "get_stateless_scope")
_BATCHNORM = ("keras.src.layers.normalization.batch_normalization", "BatchNormalization")


def require_function(module_name, attribute):
    """`module_name.attribute` as a function or class, or a KerasTowerError
    naming it and the versions."""
    found = require(module_name, attribute)
    if not callable(found):
        raise _missing(f"{module_name}.{attribute} as a function or class")
    return found


def _parameter(function, name, what):
    parameters = inspect.signature(function).parameters
    if name not in parameters:
        raise _missing(f"{what} with a `{name}` argument")
    return parameters[name]


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

    _patch(module, _MOMENTS[1], routed)
    _patch(batchnorm, "__init__", accepting_synchronized)


def current_stateless_scope():
    """The innermost open `keras.StatelessScope`, or None."""
    return require_function(*_STATELESS_SCOPE)()


def inheriting_stateless_scope(state_mapping, collect_losses=False):
    """A `keras.StatelessScope` mapping `state_mapping` (pairs of variable and
    value) over what the scope it is opened in maps, so every variable reads
    its value inside the enclosing step, not its stored one."""
    scope = keras.StatelessScope(state_mapping=state_mapping, collect_losses=collect_losses)
    outer = current_stateless_scope()
    if outer is None:
        return scope
    inherited = getattr(outer, "state_mapping", None)
    if not isinstance(inherited, dict) or not isinstance(getattr(scope, "state_mapping", None), dict):
        raise _missing("keras.StatelessScope.state_mapping as a dict of variable id to value")
    scope.state_mapping = {**inherited, **scope.state_mapping}
    return scope
