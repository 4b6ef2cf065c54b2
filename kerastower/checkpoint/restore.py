"""Reading a checkpoint folder back into a model: `kt.checkpoint.read_checkpoint`.

Every variable is matched by its key (checkpoint/keys.py) and checked for
shape, dtype and place before any is assigned: a checkpoint that does not
fit the model raises CheckpointMismatchError and changes nothing.
Writing, listing and verifying folders is store.py's.
"""

import json
import os
import warnings

import numpy as np

from kerastower.checkpoint import files as checkpoint_files
from kerastower.checkpoint import variables as checkpoint_variables
from kerastower.checkpoint.files import DamagedCheckpointError
from kerastower.checkpoint.keys import build_optimizers
from kerastower.checkpoint.keys import keyed_variables
from kerastower.checkpoint.places import variable_places
from kerastower.checkpoint.store import all_finite
from kerastower.checkpoint.store import sync
from kerastower.checkpoint.trust import state_manifest_problem
from kerastower.errors import KerasTowerError

__all__ = [
    "read_checkpoint", "restore_latest", "saved_optimizer_builds", "CheckpointMismatchError",
]


class CheckpointMismatchError(KerasTowerError):
    """A checkpoint's variables do not fit the model's.

    Attributes:
        missing: [(key, shape)] the model has and the checkpoint lacks.
        unexpected: [(key, shape)] the checkpoint has and the model lacks.
        reshaped: [(key, saved shape and dtype, model shape and dtype)].
        out_of_range: [(key, saved dtype, model dtype, value)]: integer
            variables of another integer dtype (restored with a cast) with a
            value the model's dtype cannot hold.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> path = kt.checkpoint.write_checkpoint(
        ...     "ckpt", model, {"global_step": 7, "epoch_num": 1, "local_step": 7})
        >>> wider_inputs = keras.Input((4,))
        >>> wider = kt.TowerModel(wider_inputs, keras.layers.Dense(1)(wider_inputs))
        >>> try:
        ...     kt.checkpoint.read_checkpoint(path, wider)
        ... except kt.checkpoint.CheckpointMismatchError as error:
        ...     print(error.reshaped)
        [('model/dense/kernel', '(3, 1) float32', '(4, 1) float32')]
    """

    def __init__(self, path, missing, unexpected, reshaped, out_of_range=(), moved=()):
        out_of_range, moved = list(out_of_range), list(moved)
        super().__init__(
            f"The checkpoint {path} does not fit this model:"
            f"{_describe(missing, unexpected, reshaped, out_of_range, moved)}\n"
            "Build the same model (layer names decide where weights go), point the "
            "checkpoint directory elsewhere, or pass allow_partial=True to restore the "
            "variables that fit and keep the others as they are."
        )
        self.missing = missing
        self.unexpected = unexpected
        self.reshaped = reshaped
        self.out_of_range = out_of_range
        self.moved = moved


def _describe(missing, unexpected, reshaped, out_of_range=(), moved=()):
    lines = []
    if missing:
        lines.append("\n  missing from the checkpoint (the model has them): "
                     + ", ".join(f"{key} {shape}" for key, shape in missing))
    if unexpected:
        lines.append("\n  extra in the checkpoint (the model lacks them): "
                     + ", ".join(f"{key} {shape}" for key, shape in unexpected))
    if reshaped:
        lines.append("\n  another shape or dtype: " + ", ".join(
            f"{key} saved {saved}, model {now}" for key, saved, now in reshaped))
    if out_of_range:
        lines.append("\n  an integer the model's dtype cannot hold: " + ", ".join(
            f"{key} saved {saved} holds {value}, model {now} holds "
            f"{np.iinfo(now).min} to {np.iinfo(now).max}"
            for key, saved, now, value in out_of_range))
    if moved:
        lines.append(
            "\n  a name Keras gave now names a layer elsewhere in the model (layers created "
            "in another order trade their automatic names; restoring would swap their "
            "weights): " + ", ".join(
                f"{key} was saved from the layer at {saved}, here it is the layer at {now}"
                for key, saved, now in moved)
            + ". Name these layers (e.g. keras.layers.Dense(64, name='encoder')) so that "
            "a name says which layer it is, then write a checkpoint with the names")
    return "".join(lines)


def _match(manifest, keyed):
    """(triples of (key, variable, cast) to restore, missing, unexpected,
    reshaped); `cast` is the model's dtype where the checkpoint holds the
    variable as another integer dtype of the same shape, else None."""
    saved = {v["key"]: v for v in manifest["variables"]}
    restorable, missing, reshaped = [], [], []
    for key, _, variable in keyed:
        shape, dtype = list(variable.shape), checkpoint_variables.dtype_name(variable.dtype)
        if key not in saved:
            missing.append((key, tuple(shape)))
        elif (saved[key]["shape"], saved[key]["dtype"]) == (shape, dtype):
            restorable.append((key, variable, None))
        elif (saved[key]["shape"] == shape and checkpoint_variables.is_integer(dtype)
              and checkpoint_variables.is_integer(saved[key]["dtype"])):
            restorable.append((key, variable, dtype))
        else:
            reshaped.append((key, f"{tuple(saved[key]['shape'])} {saved[key]['dtype']}",
                             f"{tuple(shape)} {dtype}"))
    known = {key for key, _, _ in keyed}
    unexpected = [
        (v["key"], tuple(v["shape"])) for v in manifest["variables"] if v["key"] not in known
    ]
    return restorable, missing, unexpected, reshaped


def _moved(manifest, restorable, places):
    """[(key, saved place, place now)] of the variables whose key now names
    an automatically named layer at another place (kerastower/checkpoint/places.py).
    Checkpoints without places (older ones) and layers the user named are
    matched by key alone."""
    saved = {v["key"]: v.get("place") for v in manifest["variables"]}
    moved = []
    for key, variable, _ in restorable:
        then, now = saved.get(key), places.get(id(variable))
        if then is not None and now is not None and then != now:
            moved.append((key, then, now))
    return moved


def _renames_by_place(manifest, keyed, places):
    """{name in the checkpoint: name here} for the layers Keras named whose
    names traded, when every saved variable with a place has exactly one
    counterpart here (the same place, variable name and shape) and the
    names map one to one; else None (the restore then refuses)."""
    here = {}
    for key, _, variable in keyed:
        if id(variable) in places:
            found = (places[id(variable)], key.rsplit("/", 1)[-1], tuple(variable.shape))
            here.setdefault(found, []).append(key)
    renames = {}
    for entry in manifest["variables"]:
        if entry.get("place") is None:
            continue
        found = here.get((entry["place"], entry["key"].rsplit("/", 1)[-1], tuple(entry["shape"])))
        if not found or len(found) != 1:
            return None
        then, now = entry["key"].split("/"), found[0].split("/")
        if len(then) != len(now):
            return None
        for a, b in zip(then, now):
            if a != b and renames.setdefault(a, b) != b:
                return None
    if len(set(renames.values())) != len(renames):
        return None
    return renames or None


def _renamed(manifest, renames):
    """The manifest with `renames` applied to every key (the optimizer's
    slots follow their layers), and {new key: key in the checkpoint}."""
    def rename(key):
        return "/".join(renames.get(part, part) for part in key.split("/"))

    variables = [dict(entry, key=rename(entry["key"])) for entry in manifest["variables"]]
    return dict(manifest, variables=variables), {
        rename(entry["key"]): entry["key"] for entry in manifest["variables"]}


def _beyond(value, dtype):
    """A value in the integer array `value` that the integer dtype `dtype`
    cannot hold (as a Python int), or None when every one fits."""
    if value.size == 0:
        return None
    info = np.iinfo(dtype)
    low, high = int(value.min()), int(value.max())
    if low < info.min:
        return low
    if high > info.max:
        return high
    return None


def saved_optimizer_builds(directory):
    """The `optimizers` entry (keys.optimizer_builds) of the newest intact
    checkpoint in `directory`, or None: what a restore from it will build.
    Every process builds these before the chief restores (loop/resume.py),
    since building under a multi-worker strategy is collective."""
    for _, path in reversed(checkpoint_files.candidates(directory)):
        try:
            return checkpoint_files.verify(path).get("optimizers")
        except DamagedCheckpointError:
            continue
    return None


def read_checkpoint(path, model, allow_partial=False):
    """Restores the model and its optimizers from the checkpoint at `path`,
    matching variables by key; returns its state dict.

    Raises DamagedCheckpointError (nothing restored) when the checkpoint is
    incomplete, damaged or holds NaN/Inf, and CheckpointMismatchError when
    the variables do not fit, unless `allow_partial`, which restores those
    that fit and warns about the others. An integer variable saved as
    another integer dtype (TensorFlow's int64 step counter, JAX's int32) is
    cast to the model's when every value fits it; a value that does not is
    a mismatch.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> path = kt.checkpoint.write_checkpoint(
        ...     "ckpt", model, {"global_step": 7, "epoch_num": 1, "local_step": 7})
        >>> kernel = model.layers[-1].kernel
        >>> saved = kernel.numpy()
        >>> _ = kernel.assign(np.zeros((3, 1)))
        >>> kt.checkpoint.read_checkpoint(path, model)
        {'epoch_num': 1, 'global_step': 7, 'local_step': 7}
        >>> bool(np.array_equal(kernel.numpy(), saved))
        True
    """
    manifest = checkpoint_files.verify(path)
    with open(os.path.join(path, checkpoint_files.STATE)) as f:
        state = json.load(f)
    problem = state_manifest_problem(state, manifest)
    if problem:
        raise DamagedCheckpointError(path, f"{checkpoint_files.STATE}: {problem}")
    build_optimizers(model, manifest.get("optimizers"), model.tower_strategy.scope)
    keyed, places = keyed_variables(model), variable_places(model)
    restorable, missing, unexpected, reshaped = _match(manifest, keyed)
    moved = _moved(manifest, restorable, places)
    in_file = {}  # key here -> key in the checkpoint, where Keras's names were traded
    renames = _renames_by_place(manifest, keyed, places) if moved else None
    if renames:
        manifest, in_file = _renamed(manifest, renames)
        restorable, missing, unexpected, reshaped = _match(manifest, keyed)
        moved = _moved(manifest, restorable, places)
        warnings.warn(
            f"kerastower: restored {path} by place: layers Keras named were created in "
            "another order, and their names traded ("
            + ", ".join(f"{then} is now {now}" for then, now in sorted(renames.items()))
            + "); each weight went to the layer at the place it was saved from. Name "
            "these layers so that a name says which layer it is.",
            stacklevel=2,
        )
    if moved:
        restorable = [r for r in restorable if r[0] not in {key for key, _, _ in moved}]
    if (missing or unexpected or reshaped or moved) and not allow_partial:
        raise CheckpointMismatchError(path, missing, unexpected, reshaped, moved=moved)
    saved_dtypes = {v["key"]: v["dtype"] for v in manifest["variables"]}
    keys = [key for key, _, _ in restorable]
    try:
        stored = checkpoint_variables.read(
            path, [in_file.get(key, key) for key in keys], [saved_dtypes[key] for key in keys])
    except (OSError, ValueError) as error:
        raise DamagedCheckpointError(path, f"unreadable variables ({error})") from None
    bad = [key for key, value in zip(keys, stored) if not all_finite(value)]
    if bad:
        raise DamagedCheckpointError(
            path, f"non-finite values (NaN or Inf) in {', '.join(bad[:5])}"
        )
    values, out_of_range = [], []
    for (key, variable, cast), value in zip(restorable, stored):
        if cast is not None:
            beyond = _beyond(value, cast)
            if beyond is not None:
                out_of_range.append((key, saved_dtypes[key], cast, beyond))
                continue
            value = value.astype(cast)
        values.append((variable, value))
    if out_of_range and not allow_partial:
        raise CheckpointMismatchError(path, [], [], [], out_of_range)
    if missing or unexpected or reshaped or out_of_range or moved:
        warnings.warn(
            f"kerastower: partial restore from {path} (allow_partial=True); not restored:"
            f"{_describe(missing, unexpected, reshaped, out_of_range, moved)}",
            stacklevel=2,
        )
    sync(model)  # else the towers' held weights would overwrite the restored ones
    for variable, value in values:
        variable.assign(value)
    return state


def restore_latest(directory, model, allow_partial=False):
    """Restores the newest intact checkpoint in `directory`; returns (path,
    state dict), or (None, None) when there is no checkpoint.

    Each damaged, incomplete or non-finite checkpoint on the way is skipped
    with a warning saying why; when there are checkpoints and none is
    intact, raises a KerasTowerError naming each and its reason.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> path = kt.checkpoint.write_checkpoint(
        ...     "ckpt", model, {"global_step": 7, "epoch_num": 1, "local_step": 7})
        >>> kt.checkpoint.restore_latest("ckpt", model)
        ('ckpt/ckpt-00000007', {'epoch_num': 1, 'global_step': 7, 'local_step': 7})
        >>> kt.checkpoint.restore_latest("no-checkpoints-here", model)
        (None, None)
    """
    skipped = []
    for _, path in reversed(checkpoint_files.candidates(directory)):
        try:
            return path, read_checkpoint(path, model, allow_partial=allow_partial)
        except DamagedCheckpointError as error:
            skipped.append((path, error.reason))
            warnings.warn(
                f"kerastower: skipping the checkpoint {path}: {error.reason}; trying an older one.",
                stacklevel=2,
            )
    if skipped:
        listing = "".join(f"\n  {path}: {reason}" for path, reason in skipped)
        raise KerasTowerError(
            f"No intact checkpoint in {directory}; every one is damaged:{listing}\n"
            "Restore one from a backup, or move them away to start training from scratch."
        )
    return None, None
