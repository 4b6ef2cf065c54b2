"""A missing backend gives an error naming the extra that installs it.

`kerastower._backend_required.check_backend_installed()` runs before Keras
is imported: it must pick the backend by Keras's own rules (compared here
with the installed Keras's config.py, run on the same environment), raise
`BackendNotInstalledError` naming `kerastower[tensorflow]` or
`kerastower[jax]` when that backend's package is missing, and import
nothing heavy itself.
"""

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

from kerastower import _backend_required
from kerastower._backend_required import BackendNotInstalledError
from kerastower._backend_required import check_backend_installed
from kerastower._backend_required import keras_backend_choice

MODULE_FILE = _backend_required.__file__
REAL_FIND_SPEC = importlib.util.find_spec


@pytest.fixture
def keras_home(tmp_path, monkeypatch):
    """A fresh KERAS_HOME, no KERAS_BACKEND, and Keras treated as not yet
    imported (this test process has imported it: the check would read its
    choice)."""
    home = tmp_path / "keras_home"
    home.mkdir()
    monkeypatch.setenv("KERAS_HOME", str(home))
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.setattr(_backend_required, "_imported_keras_backend", lambda: None)
    return home


def write_keras_json(home, config):
    path = home / "keras.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def missing(monkeypatch, *modules):
    """find_spec answers None (not installed) for these top-level modules."""

    def find_spec(name, package=None):
        if name in modules:
            return None
        return REAL_FIND_SPEC(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_missing_tensorflow_names_the_tensorflow_extra(keras_home, monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "tensorflow")
    missing(monkeypatch, "tensorflow")
    with pytest.raises(BackendNotInstalledError) as info:
        check_backend_installed()
    message = str(info.value)
    assert isinstance(info.value, ImportError)
    assert info.value.name == "tensorflow"
    assert "TensorFlow is not installed" in message
    assert 'pip install "kerastower[tensorflow]"' in message
    assert "KERAS_BACKEND=tensorflow" in message
    assert 'pip install "kerastower[jax]"' in message and "set KERAS_BACKEND=jax" in message


def test_missing_jax_names_the_jax_extra(keras_home, monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "jax")
    missing(monkeypatch, "jax")
    with pytest.raises(BackendNotInstalledError) as info:
        check_backend_installed()
    message = str(info.value)
    assert info.value.name == "jax"
    assert "JAX is not installed" in message
    assert 'pip install "kerastower[jax]"' in message
    assert "KERAS_BACKEND=jax" in message
    assert "set KERAS_BACKEND=tensorflow" in message


def test_the_default_backend_is_tensorflow_and_the_message_says_why(keras_home, monkeypatch):
    missing(monkeypatch, "tensorflow")
    with pytest.raises(BackendNotInstalledError) as info:
        check_backend_installed()
    assert "kerastower[tensorflow]" in str(info.value)
    assert "KERAS_BACKEND is unset" in str(info.value)


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_nothing_is_raised_when_the_backend_is_installed(keras_home, monkeypatch, backend):
    monkeypatch.setenv("KERAS_BACKEND", backend)
    missing(monkeypatch, "jax" if backend == "tensorflow" else "tensorflow")  # the other one
    assert check_backend_installed() is None


@pytest.mark.parametrize("backend", ["torch", "numpy", "openvino"])
def test_backends_kerastower_does_not_run_on_are_left_to_keras(keras_home, monkeypatch, backend):
    monkeypatch.setenv("KERAS_BACKEND", backend)
    missing(monkeypatch, "tensorflow", "jax", "torch", "openvino")
    assert check_backend_installed() is None


def test_keras_json_picks_the_backend_when_keras_backend_is_unset(keras_home, monkeypatch):
    path = write_keras_json(keras_home, {"backend": "jax", "floatx": "float32"})
    missing(monkeypatch, "tensorflow")   # irrelevant: keras.json says jax
    assert check_backend_installed() is None
    missing(monkeypatch, "jax")
    with pytest.raises(BackendNotInstalledError) as info:
        check_backend_installed()
    assert "kerastower[jax]" in str(info.value)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("keras_backend,picked", [
    ("tensorflow", "tensorflow"),   # KERAS_BACKEND wins over keras.json
    ("", "jax"),                    # an empty one falls back to keras.json
])
def test_keras_backend_against_keras_json(keras_home, monkeypatch, keras_backend, picked):
    write_keras_json(keras_home, {"backend": "jax"})
    monkeypatch.setenv("KERAS_BACKEND", keras_backend)
    missing(monkeypatch, picked)
    with pytest.raises(BackendNotInstalledError, match=rf"kerastower\[{picked}\]"):
        check_backend_installed()


def test_without_keras_home_keras_json_is_read_from_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("KERAS_HOME", raising=False)
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    monkeypatch.setattr(_backend_required, "_imported_keras_backend", lambda: None)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".keras").mkdir()
    write_keras_json(tmp_path / ".keras", {"backend": "jax"})
    assert keras_backend_choice()[0] == "jax"
    assert keras_backend_choice()[0] == _keras_config_backend(monkeypatch)
    # A home directory Keras cannot write to: Keras reads /tmp/.keras instead.
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode: False if path == str(tmp_path) else real_access(path, mode)
    )
    assert _backend_required._keras_json_path() == os.path.join("/tmp", ".keras", "keras.json")


def test_keras_already_imported_decides(monkeypatch):
    """Once Keras is imported its backend is fixed: a later KERAS_BACKEND
    changes nothing, and the check reads Keras's choice."""
    import keras

    monkeypatch.setenv("KERAS_BACKEND", "torch")
    assert keras_backend_choice()[0] == keras.backend.backend()


def _keras_config_backend(monkeypatch):
    """What the installed Keras's backend/config.py picks under the current
    environment, run from its source (its keras_export stubbed, so that
    nothing of this process's Keras changes)."""
    spec = REAL_FIND_SPEC("keras")
    path = os.path.join(spec.submodule_search_locations[0], "src", "backend", "config.py")
    stub = types.ModuleType("keras.src.api_export")
    stub.keras_export = lambda path: (lambda symbol: symbol)
    monkeypatch.setitem(sys.modules, "keras.src.api_export", stub)
    monkeypatch.delenv("TF_FORCE_GPU_ALLOW_GROWTH", raising=False)  # config.py sets it
    namespace = {"__name__": "keras_config_copy"}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), namespace)
    return namespace["_BACKEND"]


@pytest.mark.parametrize(
    "env,config",
    [
        (None, None),
        (None, {"backend": "jax"}),
        (None, {"backend": "tensorflow"}),
        (None, {"floatx": "float32"}),
        (None, "{not json"),
        ("", {"backend": "jax"}),
        ("jax", None),
        ("jax", {"backend": "tensorflow"}),
        ("tensorflow", {"backend": "jax"}),
        ("torch", {"backend": "jax"}),
    ],
)
def test_the_backend_is_picked_by_the_installed_keras_rules(keras_home, monkeypatch, env, config):
    if env is not None:
        monkeypatch.setenv("KERAS_BACKEND", env)
    if config is not None:
        write_keras_json(keras_home, config)
    ours = keras_backend_choice()[0]
    assert ours == _keras_config_backend(monkeypatch)


def test_the_check_imports_neither_keras_nor_a_backend(tmp_path):
    """Loaded on its own (as kerastower/__init__.py's first line runs it), the
    check leaves Keras, TensorFlow and JAX unimported."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('backend_required', {MODULE_FILE!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "module.check_backend_installed()\n"
        "print(sorted(m for m in ('keras', 'tensorflow', 'jax') if m in sys.modules))\n"
    )
    for backend in ("tensorflow", "jax"):
        env = dict(os.environ, KERAS_BACKEND=backend, KERAS_HOME=str(tmp_path))
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "[]", result.stdout
