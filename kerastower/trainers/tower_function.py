"""`kt.Trainer.tower_function`: a data-parallel step, run once per tower.

The decorated function runs once per tower, under the tower's
`TowerContext` and the tower rules, and its dict of results is reduced
over towers (weighted mean, sum, or a list). Written once: the model's
step engine runs it (`StepEngine.run_tower_function`;
backend/tensorflow/tower_function.py compiles it with `tf.function`,
backend/jax/tower_function.py with one `jax.jit` over the towers), where
the gradients a tower hands to `optimizer.apply` are reduced as fit's are.
"""

import functools

from kerastower.errors import KerasTowerError
from kerastower.model import TowerModel

__all__ = ["TowerFunction"]


class TowerFunction:
    """What `Trainer.tower_function` makes; a descriptor, so that it also
    decorates methods (each instance gets its own compiled function)."""

    def __init__(self, fn, reduce, training, owner=None):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.reduce = reduce
        self.training = training
        # A bound method of a trainer or model knows whose strategy runs it.
        self.owner = owner if owner is not None else getattr(fn, "__self__", None)
        self.runner = None  # the engine's, made on the first call

    def __get__(self, instance, owner_class=None):
        if instance is None:
            return self
        # One compiled function per instance and per definition: a subclass
        # overriding a tower function can still call super()'s.
        bound_functions = instance.__dict__.setdefault("_kerastower_tower_functions", {})
        bound = bound_functions.get(id(self))
        if bound is None:
            bound = type(self)(
                functools.partial(self.fn, instance), self.reduce, self.training, owner=instance
            )
            bound.__name__ = getattr(self.fn, "__name__", "tower_function")
            bound.__qualname__ = getattr(self.fn, "__qualname__", bound.__name__)
            bound_functions[id(self)] = bound
        return bound

    def _model(self):
        owner = self.owner
        model = owner if _is_tower_model(owner) else getattr(owner, "model", None)
        if not _is_tower_model(model):
            raise KerasTowerError(
                f"tower_function {self.__name__!r} cannot find the kt.TowerModel "
                "whose strategy runs it: decorate a method of a kt.Trainer or of "
                "a kt.TowerModel."
            )
        return model

    def __call__(self, *args):
        return self._model().engine.run_tower_function(self, args)


def _is_tower_model(obj):
    return isinstance(obj, TowerModel)
