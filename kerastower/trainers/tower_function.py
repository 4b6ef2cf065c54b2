"""`kt.Trainer.tower_function`: a data-parallel step, run once per tower.

The decorated function runs once per tower, under the tower's
`TowerContext` and the tower rules, compiled with `tf.function`, and its
dict of results is reduced over towers (weighted mean, sum, or a list).
"""

import functools

import numpy as np

from kerastower._tf import tf
from kerastower.engine import nonfinite
from kerastower.engine import step_errors
from kerastower.errors import KerasTowerError

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
        self._compiled = None

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
        model = self._model()
        if self._compiled is None:
            self._compiled = self._make(model)
        step = model.loop.global_step + 1
        try:
            outputs, (finite, bad_towers) = self._compiled(*args)
        except tf.errors.OutOfRangeError:
            raise  # the end of the input, for the trainer to handle
        except tf.errors.OpError as error:
            failure = step_errors.explain(error, f"Step {step} (tower_function {self.__name__!r})")
            raise failure from failure.__cause__
        if not bool(finite):
            raise nonfinite.error_for(
                step, np.flatnonzero(np.asarray(bad_towers)).tolist(), model.num_towers
            )
        return outputs

    def _make(self, model):
        strategy = model.tower_strategy
        reduce = self.reduce
        name = getattr(self, "__qualname__", self.__name__)

        def in_tower(*args):
            examples = _batch_size(args[0]) if args else None
            with model.tower_scope(self.training, name, examples=examples) as ctx:
                outputs = self.fn(*args)
            health = nonfinite.tower_health(ctx)
            if not isinstance(outputs, dict):
                raise KerasTowerError(
                    f"tower_function {name!r} must return a dict of values to "
                    f"reduce over towers; got {type(outputs).__name__}."
                )
            if reduce != "mean":
                return outputs, tf.constant(1.0, tf.float64), health
            if args and examples is None:
                raise KerasTowerError(
                    f"tower_function {name!r} with reduce=\"mean\" weights each tower's "
                    "values by the batch size of its first argument, which is not a batch "
                    f"(got {args[0]!r}). Pass the tower's batch first, or use "
                    "reduce=\"sum\" or None."
                )
            weight = tf.cast(1 if examples is None else examples, tf.float64)
            return {k: tf.cast(v, tf.float64) * weight for k, v in outputs.items()}, weight, health

        def run(*args):
            outputs, weights, health = strategy.run(in_tower, args=args)
            health = nonfinite.step_health(strategy, health)
            if reduce is None:
                return {k: strategy.tower_values(v) for k, v in outputs.items()}, health
            sums = {k: strategy.sum_over_towers(v) for k, v in outputs.items()}
            if reduce == "mean":
                total = strategy.sum_over_towers(weights)
                sums = {k: tf.math.divide_no_nan(v, total) for k, v in sums.items()}
            return sums, health

        if model.run_eagerly:
            return run
        return tf.function(run, reduce_retracing=True)


def _is_tower_model(obj):
    from kerastower.backend import TowerModel  # the backend's, known once Keras is

    return isinstance(obj, TowerModel)


def _batch_size(batch):
    """The number of examples in a tower's batch, or None when it is not one."""
    first = next((t for t in tf.nest.flatten(batch) if t is not None), None)
    try:
        tensor = tf.convert_to_tensor(first)
    except (TypeError, ValueError):
        return None
    if tensor.shape.rank == 0:
        return None
    return tf.shape(tensor)[0]
