"""The JAX backend's tests: 4 host devices, forced before JAX starts.

Run by scripts/test-jax.sh (a process of their own: the backend is chosen
once per process, and tests/ runs on TensorFlow)."""

import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
# tests/loop_cases.py is backend-neutral: the trainer tests of both backends share it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
# tests_shared/shared_helpers.py: what the tests of both backends share (StopAt).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests_shared"))
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import keras  # noqa: E402
import pytest  # noqa: E402

if keras.backend.backend() != "jax":
    raise RuntimeError(
        f"tests_jax/ needs KERAS_BACKEND=jax before Keras is imported; Keras runs on "
        f"{keras.backend.backend()}. Run: bash scripts/test-jax.sh")


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(1234)
    yield
