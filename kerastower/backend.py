"""The backend's classes: what Keras runs on (KERAS_BACKEND) picks them.

Backend-neutral modules (the trainers) import `TowerModel` from here, so
that on JAX they never import the TensorFlow one.
"""

from kerastower.strategies import _on_jax

if _on_jax():
    from kerastower.jax_model import TowerModel
else:
    from kerastower.model import TowerModel

__all__ = ["TowerModel"]
