"""tests/tensorflow/: what runs on TensorFlow only (tests/conftest.py gives it 4 logical CPUs)."""

from tests.helpers.common import BACKEND

if BACKEND != "tensorflow":
    raise RuntimeError(
        f"tests/tensorflow/ runs on TensorFlow; Keras runs on {BACKEND}. "
        "Run: python -m pytest (KERAS_BACKEND unset or tensorflow)")
