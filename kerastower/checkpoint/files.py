"""The files of a checkpoint folder: atomic commit, manifest, verification.

Nothing here knows about TensorFlow: `commit` stages whatever files a
`fill(folder)` function writes, adds `manifest.json`, and moves the folder
into place; `verify` checks such a folder. kerastower/checkpoint/store.py writes
the variables and the state through it.

A commit, step by step (each step survives a kill at any moment):

1. `fill` writes the files into `<dir>/.writing-<random>`.
2. Every file is fsynced and hashed; `manifest.json` (size and sha256 of
   every file, plus the caller's fields, plus a sha256 of the manifest
   itself) is written last and fsynced, then the folder is fsynced.
3. No `ckpt-N` yet: rename the folder to `ckpt-N`, fsync the directory.
   `ckpt-N` already there (a same-step replace): rename it to
   `ckpt-N.previous`, rename the new folder to `ckpt-N`, remove
   `ckpt-N.previous`, fsyncing the directory after each. A complete
   checkpoint of step N exists at every moment, under one of the two names,
   and readers try both.

A checkpoint is deleted (`remove`) by renaming it to `.deleting-*` first,
so that no half-deleted checkpoint is ever seen. A kill leaves at worst a
`.writing-*` or `.deleting-*` folder (removed by `clean_up`), or a
`ckpt-N.previous` alone (renamed back by `clean_up`).
"""

import hashlib
import json
import os
import re
import shutil
import tempfile

from kerastower.checkpoint.trust import manifest_problem
from kerastower.checkpoint.trust import npz_problem
from kerastower.checkpoint.trust import state_problem
from kerastower.checkpoint.trust import state_manifest_problem
from kerastower.errors import KerasTowerError

__all__ = [
    "DamagedCheckpointError", "commit", "verify", "read_manifest", "clean_up", "remove",
    "candidates", "folder_path", "MANIFEST", "STATE", "FORMAT",
]

MANIFEST = "manifest.json"
STATE = "state.json"
FORMAT = "kerastower-checkpoint-1"
STAGING_PREFIX = ".writing-"
DELETING_PREFIX = ".deleting-"
PREVIOUS = ".previous"
_NAME = re.compile(r"^ckpt-(\d+)(\.previous)?$")
REQUIRED_STATE = ("epoch_num", "local_step", "global_step")


class DamagedCheckpointError(KerasTowerError):
    """A checkpoint folder that is not a complete, intact, finite checkpoint.

    Attributes:
        path: the folder.
        reason: what is wrong with it, in words.

    Examples:
        >>> inputs = keras.Input((3,))
        >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        >>> path = kt.checkpoint.write_checkpoint(
        ...     "ckpt", model, {"global_step": 7, "epoch_num": 1, "local_step": 7})
        >>> os_remove = __import__("os").remove
        >>> os_remove(path + "/manifest.json")
        >>> try:
        ...     kt.checkpoint.read_checkpoint(path, model)
        ... except kt.checkpoint.DamagedCheckpointError as error:
        ...     print(error.path, "|", error.reason)
        ckpt/ckpt-00000007 | ...manifest...
    """

    def __init__(self, path, reason):
        super().__init__(
            f"The checkpoint {path} cannot be used: {reason}. Resume from an older "
            "checkpoint (AutoResume does so by itself) or delete this folder."
        )
        self.path = path
        self.reason = reason


def folder_path(directory, step):
    """Where the checkpoint of global step `step` lives in `directory`."""
    return os.path.join(directory, f"ckpt-{step:08d}")


def candidates(directory):
    """Every checkpoint folder in `directory`, intact or not, as (step,
    path), oldest step first; for one step, `ckpt-N` comes after its
    `ckpt-N.previous`, so that newest-first readers try it first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = _NAME.match(name)
        path = os.path.join(directory, name)
        if match and os.path.isdir(path):
            found.append((int(match.group(1)), match.group(2) is None, path))
    return [(step, path) for step, _, path in sorted(found)]


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path, sync=False):
    """The size and sha256 of the file at `path`, which `sync` fsyncs first."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        if sync:
            os.fsync(f.fileno())
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
            size += len(block)
    return {"bytes": size, "sha256": sha.hexdigest()}


def _self_checksum(fields):
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _write_manifest(folder, fields):
    manifest = dict(fields, checksum=_self_checksum(fields))
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def commit(directory, step, fill, fields):
    """Writes the checkpoint of `step` atomically; returns its path.

    `fill(folder)` writes the payload files into a fresh folder; `fields`
    (JSON-able) go into the manifest beside the file checksums.
    """
    os.makedirs(directory, exist_ok=True)
    final = folder_path(directory, step)
    staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=directory)
    try:
        fill(staging)
        files = {
            name: _digest(os.path.join(staging, name), sync=True)
            for name in sorted(os.listdir(staging))
        }
        _write_manifest(staging, dict(fields, format=FORMAT, global_step=step, files=files))
        fsync_dir(staging)
        _move_into_place(staging, final, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        try:  # a replace that failed midway may have set the old one aside
            _settle_previous(final, directory)
        except OSError:
            pass
        raise
    return final


def remove(path):
    """Deletes the checkpoint folder `path`: first renamed out of the
    checkpoints' names, so that a kill midway leaves no half-deleted
    checkpoint, only a `.deleting-*` folder that `clean_up` removes."""
    directory, name = os.path.split(os.path.normpath(path))
    doomed = tempfile.mkdtemp(prefix=f"{DELETING_PREFIX}{name}-", dir=directory)
    try:
        os.rename(path, os.path.join(doomed, name))
        fsync_dir(directory)
    except FileNotFoundError:  # already gone
        pass
    shutil.rmtree(doomed, ignore_errors=True)


def _settle_previous(final, directory):
    """Resolves a `ckpt-N.previous` left by a replace that was killed, so
    that at most `final` remains, keeping an intact one whenever there is."""
    previous = final + PREVIOUS
    if not os.path.isdir(previous):
        return
    if not os.path.isdir(final):
        os.rename(previous, final)
        fsync_dir(directory)
    elif _is_intact(final) or not _is_intact(previous):
        remove(previous)
    else:
        # The new one was damaged after its rename (not by a kill): keep the old.
        remove(final)
        os.rename(previous, final)
        fsync_dir(directory)


def _move_into_place(staging, final, directory):
    _settle_previous(final, directory)
    if not os.path.isdir(final):
        os.rename(staging, final)
        fsync_dir(directory)
        return
    previous = final + PREVIOUS
    os.rename(final, previous)
    fsync_dir(directory)
    os.rename(staging, final)
    fsync_dir(directory)
    remove(previous)


def clean_up(directory):
    """Removes what killed writes left in `directory`: `.writing-*` and
    `.deleting-*` folders, and `ckpt-N.previous` folders (renamed back to
    `ckpt-N` when that is missing). Returns the temporary folders removed."""
    if not os.path.isdir(directory):
        return []
    removed = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.startswith((STAGING_PREFIX, DELETING_PREFIX)) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        elif name.endswith(PREVIOUS) and _NAME.match(name):
            _settle_previous(path[: -len(PREVIOUS)], directory)
    if removed:
        fsync_dir(directory)
    return removed


def read_manifest(path):
    """The manifest of the checkpoint folder `path`, its own checksum
    checked (the files are not: see `verify`); raises DamagedCheckpointError."""
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        raise DamagedCheckpointError(
            path, f"missing {MANIFEST} (a checkpoint is complete only with one)"
        )
    try:
        with open(file) as f:
            manifest = json.load(f)
        fields = {k: v for k, v in manifest.items() if k != "checksum"}
        intact = manifest["checksum"] == _self_checksum(fields)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise DamagedCheckpointError(
            path, f"unreadable {MANIFEST} ({type(error).__name__}: {error})"
        ) from None
    if not intact:
        raise DamagedCheckpointError(path, f"checksum mismatch in {MANIFEST} itself")
    if manifest.get("format") != FORMAT:
        raise DamagedCheckpointError(
            path, f"{MANIFEST} has format {manifest.get('format')!r}, not {FORMAT!r}"
        )
    problem = manifest_problem(manifest)
    if problem:
        raise DamagedCheckpointError(path, f"{MANIFEST}: {problem}")
    return manifest


def _check_file(path, name, expected):
    file = os.path.join(path, name)
    if os.path.islink(file):
        raise DamagedCheckpointError(path, f"{name} is a symbolic link (a checkpoint holds files)")
    if not os.path.isfile(file):
        raise DamagedCheckpointError(path, f"missing file {name}")
    size = os.path.getsize(file)
    if size != expected["bytes"]:
        kind = "truncated file" if size < expected["bytes"] else "wrong size of file"
        raise DamagedCheckpointError(
            path, f"{kind} {name}: {size} bytes, the manifest says {expected['bytes']}"
        )
    if _digest(file)["sha256"] != expected["sha256"]:
        raise DamagedCheckpointError(
            path, f"checksum mismatch in {name} (sha256 differs from the manifest's)"
        )


def verify(path):
    """Checks that `path` is a complete, intact checkpoint of finite values:
    its manifest, every file's size and sha256, its state.json, and the
    manifest's finite flags. Returns the manifest; raises
    DamagedCheckpointError saying what is wrong."""
    manifest = read_manifest(path)
    match = _NAME.match(os.path.basename(os.path.normpath(path)))
    if match and int(match.group(1)) != manifest.get("global_step"):
        raise DamagedCheckpointError(
            path, f"the folder name says step {int(match.group(1))}, the manifest says "
            f"{manifest.get('global_step')}"
        )
    for name, expected in sorted(manifest["files"].items()):
        _check_file(path, name, expected)
        if name.endswith(".npz"):
            problem = npz_problem(os.path.join(path, name))
            if problem:
                raise DamagedCheckpointError(path, f"{name}: {problem}")
    try:
        with open(os.path.join(path, STATE)) as f:
            state = json.load(f)
    except (OSError, ValueError, TypeError) as error:
        raise DamagedCheckpointError(
            path, f"unreadable {STATE} ({type(error).__name__}: {error})"
        ) from None
    problem = state_problem(state, REQUIRED_STATE) or state_manifest_problem(state, manifest)
    if problem:
        raise DamagedCheckpointError(path, f"unreadable {STATE}: {problem}")
    bad = [v for v in manifest.get("variables", []) if not v.get("finite", True)]
    if bad:
        names = ", ".join(v["key"] for v in bad[:5]) + (" ..." if len(bad) > 5 else "")
        raise DamagedCheckpointError(
            path, f"non-finite values (NaN or Inf) in {len(bad)} variables: {names}"
        )
    return manifest


def _is_intact(path):
    try:
        verify(path)
        return True
    except DamagedCheckpointError:
        return False
