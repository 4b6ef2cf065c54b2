"""The TowerModel variants `kt.TowerModel(...)` makes: functional, wrapped.

Keras makes `SomeModel(inputs, outputs)` functional by rewriting the bases
of SomeModel and of its parents, which would turn TowerModel, and every
later subclass, functional for good. TowerModel instead builds a functional
twin of the class, once.
"""

import keras

from kerastower import _compat
from kerastower.model import TowerModel

__all__ = ["FunctionalTowerModel", "WrappedTowerModel", "wrap", "wrapped_by_new", "built_by_new"]


@keras.saving.register_keras_serializable(package="kerastower")
class FunctionalTowerModel(TowerModel, _compat.functional_class()):
    """What `kt.TowerModel(inputs, outputs)` makes: a functional TowerModel
    (registered, so that a saved one loads without custom_objects)."""


_FUNCTIONAL_TWINS = {TowerModel: FunctionalTowerModel}


def functional_twin(cls):
    """`cls` with Functional mixed in, for `cls(inputs, outputs)`."""
    if cls not in _FUNCTIONAL_TWINS:
        _FUNCTIONAL_TWINS[cls] = type(cls.__name__, (cls, _compat.functional_class()), {"__module__": cls.__module__})
    return _FUNCTIONAL_TWINS[cls]


def wrap(cls, model):
    """`cls.wrap(model)`: `model`'s layers as a functional `cls`, or a thin
    WrappedTowerModel calling a subclassed model."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"TowerModel.wrap takes a keras.Model; got {type(model).__name__}.")
    if isinstance(model, TowerModel):
        return model
    try:
        inputs, outputs = model.inputs, model.outputs
    except (AttributeError, ValueError):
        inputs = outputs = None
    if inputs and outputs:
        return cls(inputs=inputs, outputs=outputs, name=f"tower_{model.name}")
    return WrappedTowerModel(model)


def wrapped_by_new(cls, args, kwargs):
    """What `kt.TowerModel(model)` returns: `cls.wrap(model)`, marked so that
    the `__init__(model)` Python calls on it next leaves it as it is."""
    model = args[0]
    if len(args) > 1 or kwargs:
        extra = [type(a).__name__ for a in args[1:]] + sorted(kwargs)
        raise TypeError(
            f"kt.TowerModel(model) takes an existing Keras model alone; got also "
            f"{', '.join(extra)}. Build the Keras model as you want it (its name "
            "included), then call kt.TowerModel(model)."
        )
    built = wrap(cls, model)
    object.__setattr__(built, "_built_from_model", id(model))
    return built


def built_by_new(tower_model, args, kwargs):
    """Whether this `__init__` call is the one Python makes after
    `wrapped_by_new` (the model built already); clears the mark."""
    marker = tower_model.__dict__.get("_built_from_model")
    if marker is None or kwargs or len(args) != 1 or marker != id(args[0]):
        return False
    del tower_model.__dict__["_built_from_model"]
    return True


@keras.saving.register_keras_serializable(package="kerastower")
class WrappedTowerModel(TowerModel):
    """A TowerModel calling another, non-functional Keras model."""

    def __init__(self, model, **kwargs):
        if built_by_new(self, (model,), kwargs):
            return
        super().__init__(name=kwargs.pop("name", f"tower_{model.name}"), **kwargs)
        self.inner = model

    def call(self, inputs, training=None):
        return self.inner(inputs, training=training)
