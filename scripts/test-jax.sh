#!/usr/bin/env bash
# Runs the JAX backend's tests (tests_jax/) and the tests both backends share
# (tests_shared/, which tests/ runs on TensorFlow) in a process of their own:
# Keras picks its backend once per process. JAX gets 4 host devices (the
# towers) from XLA_FLAGS, set before it starts.
#
#   bash scripts/test-jax.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export KERAS_BACKEND=jax
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=4"
python -m pytest -q -p no:cacheprovider tests_jax tests_shared "$@"
