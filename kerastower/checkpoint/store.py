"""Writing, listing and verifying checkpoint folders: `kt.checkpoint.*`.

Reading one back into a model is restore.py's.

What a checkpoint holds, and how it is written and checked, is told in
the package's docstring (kerastower/checkpoint/__init__.py).
"""

import json
import os

import numpy as np

from kerastower.checkpoint import files as checkpoint_files
from kerastower.checkpoint import variables as checkpoint_variables
from kerastower.checkpoint.files import DamagedCheckpointError
from kerastower.checkpoint.keys import keyed_variables
from kerastower.checkpoint.keys import optimizer_builds
from kerastower.checkpoint.places import variable_places
from kerastower.errors import KerasTowerError

__all__ = [
    "write_checkpoint", "list_checkpoints", "latest_checkpoint", "verify_checkpoint",
    "clean_up", "DamagedCheckpointError", "NonFiniteCheckpointError",
]

# The numpy arrays the callbacks' states hold (EarlyStopping's best weights).
CALLBACK_ARRAYS = "callback_arrays.npz"

class NonFiniteCheckpointError(KerasTowerError):
    """The variables to checkpoint hold NaN or Inf; nothing was written.

    Attributes:
        global_step: the step of the checkpoint that was refused.
        variables: the keys of the variables that were not finite.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> _ = model.layers[-1].kernel.assign(np.full((3, 1), np.nan))
        >>> try:
        ...     kt.checkpoint.write_checkpoint("ckpt", model, {"global_step": 8, "epoch_num": 1, "local_step": 8})
        ... except kt.checkpoint.NonFiniteCheckpointError as error:
        ...     print(error.global_step, error.variables)
        8 ['model/dense/kernel']
    """

    def __init__(self, global_step, variables):
        shown = ", ".join(variables[:5])
        if len(variables) > 5:
            shown += f" and {len(variables) - 5} more"
        hold = "variables hold" if len(variables) > 1 else "variable holds"
        super().__init__(
            f"No checkpoint was written for global step {global_step}: {len(variables)} "
            f"{hold} NaN or Inf ({shown}). The older, finite checkpoints are kept; "
            "resume from one, e.g. with a lower learning rate or gradient clipping."
        )
        self.global_step = global_step
        self.variables = variables


def list_checkpoints(directory):
    """Every checkpoint folder `ckpt-<step>` in `directory`, intact or not,
    oldest first, as (step, path); `verify_checkpoint` says which are intact.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> path = kt.checkpoint.write_checkpoint(
        ...     "ckpt", model, {"global_step": 7, "epoch_num": 1, "local_step": 7})
        >>> kt.checkpoint.list_checkpoints("ckpt")
        [(7, 'ckpt/ckpt-00000007')]
    """
    found = {}
    for step, path in checkpoint_files.candidates(directory):
        found[step] = path  # ckpt-N comes after ckpt-N.previous
    return sorted(found.items())


def verify_checkpoint(path):
    """The manifest of the checkpoint at `path` if it is complete, intact and
    finite; else raises DamagedCheckpointError saying why.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> path = kt.checkpoint.write_checkpoint(
        ...     "ckpt", model, {"global_step": 7, "epoch_num": 1, "local_step": 7})
        >>> kt.checkpoint.verify_checkpoint(path)["global_step"]
        7
        >>> with open(path + "/state.json", "a") as f:      # one byte more
        ...     _ = f.write(" ")
        >>> kt.checkpoint.verify_checkpoint(path)
        Traceback (most recent call last):
        ...
        kerastower.checkpoint.files.DamagedCheckpointError: The checkpoint ckpt/ckpt-00000007 cannot be used: wrong size of file state.json: ... bytes, the manifest says .... ...
    """
    return checkpoint_files.verify(path)


def latest_checkpoint(directory):
    """The path of the newest intact checkpoint in `directory`, or None.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> path = kt.checkpoint.write_checkpoint(
        ...     "ckpt", model, {"global_step": 7, "epoch_num": 1, "local_step": 7})
        >>> kt.checkpoint.latest_checkpoint("ckpt")
        'ckpt/ckpt-00000007'
    """
    for _, path in reversed(checkpoint_files.candidates(directory)):
        try:
            checkpoint_files.verify(path)
            return path
        except DamagedCheckpointError:
            continue
    return None


def clean_up(directory):
    """Removes the temporary folders killed writes left in `directory`;
    returns the paths removed. One process writes a directory at a time.

    Examples:
        >>> import os
        >>> os.makedirs("ckpt/.writing-1234")       # what a save killed midway leaves
        >>> kt.checkpoint.clean_up("ckpt")
        ['ckpt/.writing-1234']
    """
    return checkpoint_files.clean_up(directory)


def all_finite(value):
    return not checkpoint_variables.is_floating(value.dtype) or bool(np.isfinite(value).all())


def sync(model):
    """Has the model's variables hold what its towers hold (JAX keeps the
    weights on the devices between steps), dropping that held state, so
    that what is saved is current and what is restored is used next."""
    sync = getattr(model, "jax_state_sync", None)
    if sync is not None:
        sync()


def _state_text(state):
    """`state` as JSON, or a KerasTowerError when no resume could read it."""
    missing = [key for key in checkpoint_files.REQUIRED_STATE if key not in state]
    if missing:
        raise KerasTowerError(
            f"The checkpoint state {state!r} lacks {missing}: a resume reads the "
            "loop's position from them. Give global_step, epoch_num and local_step."
        )
    try:
        return json.dumps(state, indent=1, sort_keys=True)
    except (TypeError, ValueError) as error:
        raise KerasTowerError(
            f"The checkpoint state must be JSON-able; json says: {error}. Store "
            "numbers, strings, lists and dicts."
        ) from None


def read_callback_arrays(path):
    """The numpy arrays of the callbacks' states in the checkpoint at `path`, by name."""
    file = os.path.join(path, CALLBACK_ARRAYS)
    if not os.path.exists(file):
        return {}
    with np.load(file, allow_pickle=False) as arrays:
        return {name: arrays[name] for name in arrays.files}


def write_checkpoint(directory, model, state, retention=None, callback_arrays=None):
    """Writes the variables of `model` and its optimizers, and `state` (a
    JSON-able dict with a `global_step`), as `ckpt-<global_step>`; returns
    its path. `retention` (JSON-able) goes into the manifest;
    `callback_arrays` (numpy arrays by name: those the callbacks' states in
    `state` hold) go beside the variables. Raises NonFiniteCheckpointError,
    writing nothing, when a variable holds NaN or Inf.

    `state` must hold `global_step`, `epoch_num` and `local_step` (the loop's
    position, which a resume reads); other JSON-able keys are kept.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> kt.checkpoint.write_checkpoint(
        ...     "ckpt", model, {"global_step": 7, "epoch_num": 1, "local_step": 7})
        'ckpt/ckpt-00000007'
    """
    state_text = _state_text(state)
    step = int(state["global_step"])
    sync(model)
    keyed = keyed_variables(model)
    values = [checkpoint_variables.host_value(v) for _, _, v in keyed]
    finite = [all_finite(value) for value in values]
    bad = [key for (key, _, _), ok in zip(keyed, finite) if not ok]
    if bad:
        raise NonFiniteCheckpointError(step, bad)

    def fill(folder):
        checkpoint_variables.write(folder, [key for key, _, _ in keyed], values)
        with open(os.path.join(folder, checkpoint_files.STATE), "w") as f:
            f.write(state_text)
        if callback_arrays:
            np.savez(os.path.join(folder, CALLBACK_ARRAYS), **callback_arrays)

    places = variable_places(model)
    fields = {
        "variables": [
            {"key": key, "path": path, "shape": list(value.shape),
             "dtype": checkpoint_variables.dtype_name(value.dtype), "finite": ok,
             **({"place": places[id(variable)]} if id(variable) in places else {})}
            for (key, path, variable), value, ok in zip(keyed, values, finite)
        ],
        "retention": retention or {},
        "optimizers": optimizer_builds(model),
    }
    return checkpoint_files.commit(directory, step, fill, fields)
