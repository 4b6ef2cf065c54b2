"""TensorFlow, imported on first use, so that the JAX path never imports it.

Modules that the JAX backend shares (the loop, callbacks, tower contexts)
write `from kerastower._tf import tf` and touch `tf` only in what runs on
TensorFlow.
"""

import importlib
import sys
import types


class _OnFirstUse(types.ModuleType):
    """A module imported when one of its attributes is first read."""

    def __getattr__(self, name):
        module = importlib.import_module(self.__name__)
        self.__dict__.update(module.__dict__)
        return getattr(module, name)


tf = _OnFirstUse("tensorflow")


def tf_loaded():
    """Whether TensorFlow is imported: only then can a value be one of its types."""
    return "tensorflow" in sys.modules
