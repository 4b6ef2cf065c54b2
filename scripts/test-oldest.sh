#!/usr/bin/env bash
# Runs the equivalence and shared loop tests on the oldest Keras / TensorFlow pair kerastower
# supports (pyproject.toml's lower bounds), in a virtual environment of its
# own, cached so that later runs take seconds to set up. Arguments go to
# pytest (the README's command runs it on 2 pytest-xdist workers).
#
#   bash scripts/test-oldest.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."

TF=2.16.2
KERAS=3.10.0
PYTHON=${PYTHON:-python}
py_tag=$("$PYTHON" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
venv=${KERASTOWER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kerastower}/venv-tf$TF-keras$KERAS-$py_tag

say() { echo "test-oldest: $*"; }

if [ ! -f "$venv/.ready" ]; then
  say "making $venv (TensorFlow $TF, Keras $KERAS); this downloads about 250 MB once."
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/pip" install -q "tensorflow-cpu==$TF" "keras==$KERAS" pytest pytest-xdist scikit-learn
  touch "$venv/.ready"
fi
# A cached environment made before pytest-xdist was in the list above gets it now.
"$venv/bin/python" -c 'import xdist' 2>/dev/null || "$venv/bin/pip" install -q pytest-xdist
"$venv/bin/pip" install -q --no-deps -e .
say "$("$venv/bin/python" -c 'import keras, tensorflow as tf; print(f"Keras {keras.__version__}, TensorFlow {tf.__version__}")')"
"$venv/bin/python" -c 'import jax' 2>/dev/null && { say "JAX is installed in $venv, which must have TensorFlow only" >&2; exit 1; }; say "import jax fails: these tests run the TensorFlow path without JAX installed."
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" \
  tests/tensorflow/test_equivalence_matrix.py tests/tensorflow/test_equivalence.py tests/tensorflow/test_one_engine.py \
  tests/shared/test_trainers.py
