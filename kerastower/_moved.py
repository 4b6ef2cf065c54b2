"""Module paths of kerastower 0.1 that moved: they keep working for one
release, with a DeprecationWarning naming the new path.

`import kerastower.jax_model` gives the module now at
`kerastower.backend.jax.model` (the same module object, so what a user
patches there is patched).
"""

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

__all__ = ["MOVED", "install"]

# The old path -> where that module lives now.
MOVED = {
    "kerastower.engine.tf_step": "kerastower.backend.tensorflow.step",
    "kerastower.engine.gradients": "kerastower.backend.tensorflow.gradients",
    "kerastower.engine.xla": "kerastower.backend.tensorflow.xla",
    "kerastower.engine.collectives": "kerastower.backend.tensorflow.collectives",
    "kerastower.engine.step_errors": "kerastower.backend.tensorflow.step_errors",
    "kerastower.engine.nonfinite": "kerastower.backend.tensorflow.nonfinite",
    "kerastower.inference_loops": "kerastower.loop.inference_loops",
    "kerastower.batch_checks": "kerastower.backend.tensorflow.batch_checks",
    "kerastower.jax_model": "kerastower.model",
    "kerastower.engine.jax_step": "kerastower.backend.jax.step",
    "kerastower.engine.jax_sync": "kerastower.backend.jax.sync",
    "kerastower.engine.jax_towers": "kerastower.backend.jax.towers",
    "kerastower.engine.jax_placement": "kerastower.backend.jax.placement",
    "kerastower.trainers.jax_tower_function": "kerastower.backend.jax.tower_function",
    "kerastower.array_input": "kerastower.backend.tensorflow.array_input",
    "kerastower.python_feed": "kerastower.inputs.python_feed",
    "kerastower.jax_sources": "kerastower.backend.jax.inputs",
    "kerastower.jax_inputs": "kerastower.backend.jax.array_batches",
    "kerastower.inputs.arrays": "kerastower.backend.tensorflow.array_input",
    "kerastower.inputs.python_input": "kerastower.backend.tensorflow.python_input",
    "kerastower.inputs.as_source": "kerastower.backend.tensorflow.inputs",
    "kerastower.inputs.jax_sources": "kerastower.backend.jax.inputs",
    "kerastower.inputs.jax_arrays": "kerastower.backend.jax.array_batches",
    "kerastower.mirrored": "kerastower.strategies.mirrored",
    "kerastower.horovod": "kerastower.strategies.horovod",
    "kerastower.multiworker": "kerastower.strategies.multiworker",
    "kerastower.devices": "kerastower.strategies.devices",
    "kerastower.jax_strategies": "kerastower.strategies.jax_mesh",
    "kerastower.jax_multihost": "kerastower.strategies.jax_multihost",
    "kerastower.checkpoint_files": "kerastower.checkpoint.files",
    "kerastower.checkpoint_keys": "kerastower.checkpoint.keys",
    "kerastower.checkpoint_variables": "kerastower.checkpoint.variables",
    "kerastower.resume": "kerastower.checkpoint.resume_state",
    "kerastower.training_state": "kerastower.checkpoint.training_state",
    "kerastower.fit_steps": "kerastower.loop.fit_steps",
}
# Old packages that are gone: an empty package, so their old modules import.
_GONE_PACKAGES = {"kerastower.engine": "kerastower.backend.tensorflow / kerastower.backend.jax"}


def _no_attribute(package, attr):
    raise AttributeError(f"module {package!r} has no attribute {attr!r}")


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self._specs = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED or fullname in _GONE_PACKAGES:
            return importlib.util.spec_from_loader(
                fullname, self, is_package=fullname in _GONE_PACKAGES)
        return None

    def create_module(self, spec):
        if spec.name in _GONE_PACKAGES:
            module = types.ModuleType(spec.name, f"Moved to {_GONE_PACKAGES[spec.name]}.")
            module.__path__ = []
            # `kt.engine.tf_step` without importing it first, as before.
            module.__getattr__ = lambda attr, package=spec.name: attribute(f"{package}.{attr}") \
                if is_moved(f"{package}.{attr}") else _no_attribute(package, attr)
            return module
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old path works until kerastower 0.3. "
            f"Import {new} (or the public names from kerastower) instead.",
            DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # The import system gave the moved module the old path's spec; it
        # keeps its own.
        if module.__name__ != module.__spec__.name and module.__spec__.name in self._specs:
            module.__spec__ = self._specs.pop(module.__spec__.name)


def is_moved(name):
    """Whether `name` is an old module path (or gone package) this finder serves."""
    return name in MOVED or name in _GONE_PACKAGES


def attribute(name):
    """The module at old path `name`, read as an attribute (`kt.mirrored`),
    with the warning pointing at the user's line."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module(name)
    if name in MOVED:
        warnings.warn(
            f"{name} moved to {MOVED[name]}; the old path works until kerastower 0.3. "
            f"Import {MOVED[name]} (or the public names from kerastower) instead.",
            DeprecationWarning, stacklevel=3)
    return module


def install():
    """Puts the finder of moved modules on `sys.meta_path`, once."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
