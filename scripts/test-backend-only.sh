#!/usr/bin/env bash
# Checks that kerastower needs only the backend it runs on: in a virtual
# environment with only the `jax` extra installed (`pip install -e ".[jax]"`,
# no TensorFlow), it trains the README's example on 2 JAX towers with fit and
# evaluate without importing TensorFlow, and a run on TensorFlow there fails
# with the error naming `kerastower[tensorflow]`. The environment is made
# once and cached (remade when pyproject.toml's dependencies change), so
# that later runs take seconds to set up. (The other half, TensorFlow
# without JAX, is scripts/test-oldest.sh's environment.)
#
#   bash scripts/test-backend-only.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# 1 once kerastower/__init__.py calls check_backend_installed() first: then
# `import kerastower` itself must fail with the clear error, not only the
# check called on its own.
INIT_CHECKS_BACKEND=${INIT_CHECKS_BACKEND:-1}

PYTHON=${PYTHON:-python}
py_tag=$("$PYTHON" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
venv=${KERASTOWER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kerastower}/venv-jax-only-$py_tag
# The dependencies it was made for: pyproject.toml's base ones and the jax extra.
deps=$(sed -n '/^dependencies = \[/,/^\]/p; /^jax = /p' pyproject.toml | sha256sum | cut -d' ' -f1)

say() { echo "test-backend-only: $*"; }
fail() { echo "test-backend-only: FAILED: $*" >&2; exit 1; }

if [ ! -f "$venv/.ready" ] || [ "$(cat "$venv/.ready")" != "$deps" ]; then
  say "making $venv (kerastower's jax extra only); this downloads JAX, Keras and their dependencies once (about 760 MB installed)."
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/pip" install -q -e ".[jax]"
  echo "$deps" > "$venv/.ready"
fi
"$venv/bin/pip" install -q --no-deps -e .
say "$("$venv/bin/python" -c 'import importlib.metadata as m; print(", ".join(f"{p} {m.version(p)}" for p in ("keras", "jax", "jaxlib", "numpy", "tensorboard")))')"

# Keras's keras.json and the towers' devices: nothing of this machine's own set-up.
keras_home=$(mktemp -d)
trap 'rm -rf "$keras_home"' EXIT

# (a) The jax extra brings no TensorFlow.
if "$venv/bin/python" -c 'import tensorflow' 2>/dev/null; then
  "$venv/bin/pip" show tensorflow tensorflow-cpu 2>/dev/null | grep -E '^(Name|Version|Required-by)' >&2 || true
  fail "TensorFlow is installed in $venv, which has only kerastower's jax extra: a dependency pulls it (Required-by above)."
fi
say "(a) import tensorflow fails: TensorFlow is not installed."

# (b) The README's example trains 2 towers on JAX, TensorFlow never imported.
KERAS_HOME=$keras_home/b KERAS_BACKEND=jax XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=2" \
  "$venv/bin/python" tests/backend_only/train_on_jax.py
say "(b) the README's example trained 2 towers on JAX without TensorFlow."

# (c) On TensorFlow (asked for, or Keras's default), the error names the extra.
check_tf_error() {  # $1: what was run; stdin: its output
  local out
  out=$(cat)
  grep -q 'BackendNotInstalledError' <<<"$out" \
    || fail "$1 did not raise BackendNotInstalledError; it said:"$'\n'"$out"
  grep -q 'kerastower\[tensorflow\]' <<<"$out" \
    || fail "$1 did not name kerastower[tensorflow]; it said:"$'\n'"$out"
}
check_alone='
import importlib.util
spec = importlib.util.spec_from_file_location("backend_required", "kerastower/_backend_required.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)  # without kerastower/__init__.py, which imports Keras
module.check_backend_installed()
'
mkdir "$keras_home/c"  # no keras.json: Keras's default backend, TensorFlow
for backend in "KERAS_BACKEND=tensorflow" "KERAS_BACKEND unset"; do
  if [ "$backend" = "KERAS_BACKEND unset" ]; then set_backend=(-u KERAS_BACKEND); else set_backend=("$backend"); fi
  run=(env "${set_backend[@]}" KERAS_HOME="$keras_home/c" "$venv/bin/python" -c)
  out=$("${run[@]}" "$check_alone" 2>&1) \
    && fail "check_backend_installed() with $backend passed, and TensorFlow is missing"
  check_tf_error "check_backend_installed() with $backend" <<<"$out"
  if [ "$INIT_CHECKS_BACKEND" = 1 ]; then
    out=$("${run[@]}" 'import kerastower' 2>&1) \
      && fail "import kerastower with $backend passed, and TensorFlow is missing"
    check_tf_error "import kerastower with $backend" <<<"$out"
  fi
done
say "(c) with KERAS_BACKEND=tensorflow or unset, check_backend_installed() names kerastower[tensorflow]."
if [ "$INIT_CHECKS_BACKEND" = 1 ]; then
  say "(c) and so does import kerastower."
elif grep -q 'check_backend_installed()' kerastower/__init__.py; then
  say "(c) kerastower/__init__.py calls check_backend_installed(): set INIT_CHECKS_BACKEND=1 in this script to check import kerastower too."
else
  say "(c) import kerastower itself not checked: kerastower/__init__.py does not call check_backend_installed() yet."
fi
