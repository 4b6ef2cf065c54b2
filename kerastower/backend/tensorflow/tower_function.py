"""Tower functions on TensorFlow: `tf.function` over `strategy.run`.

What `StepEngine.run_tower_function` runs for a `kt.Trainer.tower_function`
(trainers/tower_function.py) on TensorFlow. Inside a tower,
`optimizer.apply` reduces the gradients as in fit's step (gradients.py).
"""

import numpy as np

from kerastower._tf import tf
from kerastower.backend.tensorflow import nonfinite
from kerastower.backend.tensorflow import step_errors
from kerastower.backend import engine
from kerastower.checkpoint.training_state import training_optimizers
from kerastower.errors import KerasTowerError

__all__ = ["TowerFunctionRunner"]


class TowerFunctionRunner(engine.TowerFunctionRunner):
    """Compiles and runs one tower function on TensorFlow: a `tf.function`
    over `strategy.run`."""

    def __call__(self, model, args):
        if self._compiled is None:
            self._compiled = self._make(model)
        step = model.loop.global_step + 1
        try:
            outputs, (finite, bad_towers) = self._compiled(*args)
        except tf.errors.OutOfRangeError:
            raise  # the end of the input, for the trainer to handle
        except tf.errors.OpError as error:
            failure = step_errors.explain(error, f"Step {step} (tower_function {self.__name__!r})",
                                          model.engine.failures)
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
        held = training_optimizers(model)

        def in_tower(*args):
            examples = _batch_size(args[0]) if args else None
            with model.tower_scope(self.training, name, examples=examples) as ctx:
                ctx.held_optimizers = held
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
