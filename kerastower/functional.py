"""The TowerModel variants `kt.TowerModel(...)` makes: functional, wrapped.

Keras makes `SomeModel(inputs, outputs)` functional by rewriting the bases
of SomeModel and of its parents, which would turn TowerModel, and every
later subclass, functional for good. TowerModel instead builds a functional
twin of the class, once.
"""

import inspect

import keras

from kerastower import _compat
from kerastower.model import TowerModel

__all__ = ["FunctionalTowerModel", "WrappedTowerModel"]


@keras.saving.register_keras_serializable(package="kerastower")
class FunctionalTowerModel(TowerModel, _compat.functional_class()):
    """What `kt.TowerModel(inputs, outputs)` makes: a functional TowerModel."""


_FUNCTIONAL_TWINS = {TowerModel: FunctionalTowerModel}


def init_takes_inputs_outputs(cls):
    """Whether `cls(a, b)` means `(inputs, outputs)`: its `__init__` is
    TowerModel's or starts with those parameters (a subclass taking, say,
    a generator and a discriminator is not functional)."""
    if cls.__init__ is TowerModel.__init__:
        return True
    params = list(inspect.signature(cls.__init__).parameters.values())[1:3]
    passes_through = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    if params and params[0].kind in passes_through:
        return True
    return [p.name for p in params] == ["inputs", "outputs"]


def functional_twin(cls):
    """`cls` with Functional mixed in, for `cls(inputs, outputs)`."""
    if cls not in _FUNCTIONAL_TWINS:
        _FUNCTIONAL_TWINS[cls] = type(cls.__name__, (cls, _compat.functional_class()), {"__module__": cls.__module__})
    return _FUNCTIONAL_TWINS[cls]


@keras.saving.register_keras_serializable(package="kerastower")
class WrappedTowerModel(TowerModel):
    """A TowerModel calling another, non-functional Keras model."""

    def __init__(self, model, **kwargs):
        super().__init__(name=kwargs.pop("name", f"tower_{model.name}"), **kwargs)
        self.inner = model

    def call(self, inputs, training=None):
        return self.inner(inputs, training=training)
