"""The step engines, one subpackage per Keras backend: the one dispatch point.

`backend/tensorflow/` runs the towers with `tf.distribute` (a `tf.function`
over `strategy.run`); `backend/jax/` with one jitted `shard_map` over a
device mesh. What differs between them is picked here, by the backend Keras
runs on (as Keras picks its trainer): the tower steps `TowerModel` inherits
(`tower_steps()`), the `StepEngine` (engine.py) through which the model
and the loop run them (`make_engine(model)`), kt.Trainer's feed
(`trainer_feed()`) and `kt.minimize`'s step (`minimize_step()`).
"""

from kerastower._backend_required import running_backend

__all__ = ["name", "tower_steps", "make_engine", "trainer_feed", "minimize_step",
           "evaluation_source", "exact_float"]


def name():
    """The backend Keras runs on: "tensorflow" or "jax"."""
    return running_backend()


def tower_steps():
    """The backend's part of `TowerModel`: its tower steps (a mixin class)."""
    if name() == "jax":
        from kerastower.backend.jax.model import TowerModelBackend
    else:
        from kerastower.backend.tensorflow.model import TowerModelBackend
    return TowerModelBackend


def make_engine(model):
    """The backend's `StepEngine` for `model`."""
    if name() == "jax":
        from kerastower.backend.jax.engine import JaxEngine as Engine
    else:
        from kerastower.backend.tensorflow.engine import TensorFlowEngine as Engine
    return Engine(model)


def trainer_feed():
    """The class of kt.Trainer's feed on this backend (what `next_batches()` reads)."""
    if name() == "jax":
        from kerastower.backend.jax.trainer_feed import JaxFeed as Feed
    else:
        from kerastower.backend.tensorflow.trainer_feed import TensorFlowFeed as Feed
    return Feed


def minimize_step():
    """The backend's `kt.minimize`: one optimizer step on a loss."""
    if name() == "jax":
        from kerastower.backend.jax.minimize import minimize_step as step
    else:
        from kerastower.backend.tensorflow.minimize import minimize_step as step
    return step


def evaluation_source(x, y=None, sample_weight=None, batch_size=None):
    """What evaluate would read `x` (and `y`, `sample_weight`) as, made and
    checked before any model runs (InferenceRunner, when constructed)."""
    if name() == "jax":
        from kerastower.backend.jax.inputs import tower_batches

        return tower_batches(x, y, sample_weight, batch_size)
    from kerastower.backend.tensorflow.inputs import as_input_source

    return as_input_source(x, y, sample_weight, batch_size)


def exact_float():
    """The dtype in which counts are exact: float64, or float32 on JAX
    (whose x64 is off by default)."""
    return "float32" if name() == "jax" else "float64"
