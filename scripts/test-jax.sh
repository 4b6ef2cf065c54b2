#!/usr/bin/env bash
# Runs the tests on JAX: tests/jax/ and tests/shared/ (tests/conftest.py
# leaves tests/tensorflow/ out, and gives JAX 4 forced host devices, the
# towers, before it starts). `python -m pytest` alone runs tests/tensorflow/
# and tests/shared/ on TensorFlow; Keras picks its backend once per process.
#
#   bash scripts/test-jax.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
export KERAS_BACKEND=jax
python -m pytest -q -p no:cacheprovider "$@"
