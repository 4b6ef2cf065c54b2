#!/usr/bin/env bash
# Builds Horovod 0.28.1 with Gloo for the TensorFlow of the active Python and
# installs it there. The built wheel is cached per TensorFlow and Python
# version, so the next install takes seconds.
#
#   bash scripts/install-horovod.sh
#
# Needs: the TensorFlow you train with, already installed; cmake; a C++
# compiler (g++); network access to the package registry the first time.
# Why a build: PyPI has only Horovod's source, and as published it does not
# compile against TensorFlow >= 2.16 (horovod/tensorflow/xla_mpi_ops.cc
# includes an XLA header TF no longer ships). That file only serves
# XLA-compiled GPU steps, so the build leaves it out.
set -euo pipefail

HOROVOD_VERSION=0.28.1
PYTHON=${PYTHON:-python}
CACHE_DIR=${KERASTOWER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kerastower}/wheels

say() { echo "install-horovod: $*"; }
fail() { echo "install-horovod: ERROR: $*" >&2; exit 1; }

tf_version=$("$PYTHON" -c "import tensorflow as tf; print(tf.__version__)" 2>/dev/null) \
  || fail "TensorFlow is not importable with '$PYTHON'. Install it first (pip install tensorflow), or set PYTHON=/path/to/python."
py_tag=$("$PYTHON" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")

if "$PYTHON" -c "import horovod.tensorflow as hvd; import horovod; assert horovod.__version__ == '$HOROVOD_VERSION'" 2>/dev/null \
   && [ -f "$CACHE_DIR/.installed-tf$tf_version-$py_tag" ]; then
  say "Horovod $HOROVOD_VERSION is already installed for TensorFlow $tf_version."
  exit 0
fi

cached="$CACHE_DIR/tf$tf_version-$py_tag"
wheel=$(ls "$cached"/horovod-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
  for tool in cmake g++; do
    command -v "$tool" >/dev/null 2>&1 || fail "'$tool' is needed to build Horovod. On Debian/Ubuntu: apt-get install -y cmake g++."
  done
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  say "building Horovod $HOROVOD_VERSION for TensorFlow $tf_version ($py_tag); this takes about 5 minutes on 2 cores."
  "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work" \
    || fail "could not download the Horovod $HOROVOD_VERSION source from the package registry."
  tar -xzf "$work"/horovod-"$HOROVOD_VERSION".tar.gz -C "$work"
  src="$work/horovod-$HOROVOD_VERSION"
  cmakelists="$src/horovod/tensorflow/CMakeLists.txt"
  grep -q 'xla_mpi_ops.cc' "$cmakelists" || fail "unexpected Horovod source: no xla_mpi_ops.cc line in $cmakelists."
  sed -i 's|^\(\s*list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")\)|# \1|' "$cmakelists"
  "$PYTHON" -m pip install --quiet "cloudpickle" "psutil" "pyyaml" "packaging" "cffi>=1.4.0" \
    || fail "could not install Horovod's Python dependencies."
  log="$work/build.log"
  if ! (cd "$src" && HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
        HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
        "$PYTHON" -m pip wheel --no-build-isolation --no-deps . -w "$work/dist" >"$log" 2>&1); then
    echo "----- last lines of the build log -----" >&2
    tail -n 40 "$log" >&2
    fail "the Horovod build failed (log above). Check that cmake and g++ work and that TensorFlow $tf_version's headers are installed."
  fi
  mkdir -p "$cached"
  cp "$work"/dist/horovod-*.whl "$cached"/
  wheel=$(ls "$cached"/horovod-*.whl | head -n 1)
  say "built and cached $wheel"
else
  say "using the cached wheel $wheel"
fi

"$PYTHON" -m pip install --quiet "cloudpickle" "psutil" "pyyaml" "packaging" "cffi>=1.4.0"
"$PYTHON" -m pip install --quiet --no-deps --force-reinstall "$wheel" \
  || fail "could not install $wheel."
"$PYTHON" -c "import horovod.tensorflow as hvd; hvd.init(); assert hvd.size() == 1" \
  || fail "Horovod installed but does not load with TensorFlow $tf_version; remove $cached and run again."
command -v horovodrun >/dev/null 2>&1 || fail "horovodrun is not on PATH after the install."
touch "$CACHE_DIR/.installed-tf$tf_version-$py_tag"
say "Horovod $HOROVOD_VERSION is installed for TensorFlow $tf_version; launch with: horovodrun -np 2 -H localhost:2 --gloo python train.py"
