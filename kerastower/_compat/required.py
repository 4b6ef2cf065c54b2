"""Finding a private Keras, TensorFlow or JAX name, or failing loudly.

Every private name kerastower uses is looked up through `require` (or
`_method`) when first needed; a name that moved raises a KerasTowerError
naming it, the installed versions and the tested ones, never an
AttributeError deep inside a step.
"""

import functools
import importlib

import keras

from kerastower._backend_required import running_backend
from kerastower._tf import tf
from kerastower.errors import KerasTowerError

__all__ = ["TESTED", "TESTED_ON_JAX", "require"]

# The pairs CI runs: the newest (all tests) and the oldest pyproject.toml
# allows (scripts/test-oldest.sh: the equivalence tests).
TESTED = "Keras 3.15.1 with TensorFlow 2.21, and Keras 3.10.0 with TensorFlow 2.16.2"
TESTED_ON_JAX = "Keras 3.15.1 with JAX 0.10.2 (Keras 3.10.0's source has the same hooks)"


def _on_jax():
    return running_backend() == "jax"


def _versions():
    if _on_jax():
        import jax  # the backend in use: imported already

        return f"Keras {keras.__version__}, JAX {jax.__version__}"
    if running_backend() != "tensorflow":
        return f"Keras {keras.__version__} on {running_backend()}"
    return f"Keras {keras.__version__}, TensorFlow {tf.__version__}"


def _missing(what, error=None):
    detail = f" ({type(error).__name__}: {error})" if error is not None else ""
    tested, pair = ((TESTED_ON_JAX, "'keras==3.15.*' 'jax==0.10.*'") if _on_jax()
                    else (TESTED, "'tensorflow==2.21.*' 'keras==3.15.*'"))
    return KerasTowerError(
        f"kerastower needs {what}, which this installation does not have{detail}. "
        f"Installed: {_versions()}; kerastower is tested with {tested}. Install a "
        f"tested pair, e.g. pip install {pair}."
    )


@functools.cache
def require(module_name, attribute):
    """`module_name.attribute`, or a KerasTowerError naming it and the versions."""
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise _missing(f"{module_name}.{attribute}", error) from None


def _method(obj, name):
    method = getattr(obj, name, None)
    if method is None:
        raise _missing(f"{type(obj).__name__}.{name}")
    return method
