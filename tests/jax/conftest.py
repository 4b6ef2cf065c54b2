"""tests/jax/: what runs on JAX only (tests/conftest.py gives it 4 host devices)."""

from tests.helpers.common import BACKEND

if BACKEND != "jax":
    raise RuntimeError(
        f"tests/jax/ needs KERAS_BACKEND=jax before Keras is imported; Keras runs on "
        f"{BACKEND}. Run: bash scripts/test-jax.sh")
