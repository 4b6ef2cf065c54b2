"""What a checkpoint folder may hold: every field a reader uses, checked before it is used.

A checkpoint folder is data, never code: nothing in it is imported,
unpickled or executed. kerastower/checkpoint/files.py asks these checks
while it verifies a folder, and a folder that fails one is a damaged
checkpoint (skipped, with the reason these return, for an older one):

- `manifest_problem`: the manifest's fields, their types and ranges; every
  file name a plain name inside the folder (no path, no `..`);
- `state_problem`: the loop position in state.json: each number's type and
  range, and the numbers against one another (`_position_problem`);
- `state_manifest_problem`: the state's step against the manifest's;
- `npz_problem`: every member of the variables' .npz a .npy array whose
  dtype holds no Python objects (numpy would unpickle those).

docs/reliability.md ("What a checkpoint trusts") lists them for users.

Examples:
    >>> from kerastower.checkpoint.trust import manifest_problem
    >>> manifest_problem({"global_step": 3, "files": {"../../secret.txt": {}}})
    "the file name '../../secret.txt' leaves the checkpoint folder (a plain name is allowed)"
"""

import math
import os
import re
import zipfile

import numpy as np

__all__ = [
    "manifest_problem", "state_problem", "state_manifest_problem", "npz_problem",
    "MAX_COUNT", "MAX_TOWERS", "MAX_STEPLESS_EPOCHS",
]

# Bounds no run reaches, past which a number is forged or garbled (a resume
# that believed it would skip a billion batches, or train nothing):
MAX_COUNT = 2**53 - 1  # any step or batch count (JSON's exact integers; a step a nanosecond: 285 years)
MAX_TOWERS = 65536     # towers of one run; also the most a step's batches in all may be
                       # worth in the batches of a run resumed on fewer towers or smaller ones
MAX_STEPLESS_EPOCHS = 65536  # epochs begun without a step: those fit's initial_epoch skips


def _is_count(value, minimum=0, maximum=MAX_COUNT):
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= maximum


def _file_name_problem(name):
    if not isinstance(name, str) or not name:
        return f"a file name must be a string, got {name!r}"
    if name in (".", "..") or "/" in name or "\\" in name or os.path.isabs(name) or "\0" in name:
        return f"the file name {name!r} leaves the checkpoint folder (a plain name is allowed)"
    return None


def manifest_problem(manifest):
    """What is wrong with a manifest's fields, in words, or None."""
    if not _is_count(manifest.get("global_step")):
        return (f"global_step must be an integer from 0 to {MAX_COUNT}, "
                f"got {manifest.get('global_step')!r}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return f"files must map file names to their size and sha256, got {type(files).__name__}"
    for name, expected in files.items():
        problem = _file_name_problem(name)
        if problem:
            return problem
        if not (isinstance(expected, dict) and _is_count(expected.get("bytes"))
                and isinstance(expected.get("sha256"), str)
                and re.fullmatch(r"[0-9a-f]{64}", expected["sha256"])):
            return f"files[{name!r}] must hold bytes (an integer >= 0) and a sha256, got {expected!r}"
    variables = manifest.get("variables", [])
    if not isinstance(variables, list):
        return f"variables must be a list, got {type(variables).__name__}"
    for entry in variables:
        if not (isinstance(entry, dict) and isinstance(entry.get("key"), str)
                and isinstance(entry.get("dtype"), str)
                and isinstance(entry.get("shape"), list)
                and all(_is_count(d) for d in entry["shape"])
                and isinstance(entry.get("finite", True), bool)
                and isinstance(entry.get("place", ""), str)):
            return (f"each variables entry needs a key, a dtype, a shape of integers >= 0 "
                    f"and a finite flag; got {entry!r}")
    if not isinstance(manifest.get("retention", {}), dict):
        return f"retention must be a dict, got {manifest.get('retention')!r}"
    optimizers = manifest.get("optimizers", {})
    if not (isinstance(optimizers, dict) and all(
            isinstance(name, str) and isinstance(keys, list) and all(isinstance(k, str) for k in keys)
            for name, keys in optimizers.items())):
        return ("optimizers must map each optimizer's attribute to the keys of the "
                f"variables it was built on, got {optimizers!r}")
    return None


def state_problem(state, required):
    """What is wrong with the loop position in state.json, in words, or None:
    each field's type and range, then the numbers against one another."""
    if not isinstance(state, dict):
        return f"it must hold a JSON object, got {type(state).__name__}"
    missing = [key for key in required if key not in state]
    if missing:
        return f"it lacks {missing}"
    for key in required:
        if not _is_count(state[key]):
            if isinstance(state[key], int) and not isinstance(state[key], bool) and state[key] > MAX_COUNT:
                return f"{key} {state[key]} is beyond any run's count (at most {MAX_COUNT})"
            return f"{key} must be an integer >= 0, got {state[key]!r}"
    checks = {
        "steps_per_epoch": lambda v: v is None or _is_count(v, 1),
        "num_towers": lambda v: _is_count(v, 1),
        "batch_size": lambda v: v is None or _is_count(v, 1),
        "tower_batches": lambda v: isinstance(v, list) and all(_is_count(b) for b in v),
        "epoch_ended": lambda v: isinstance(v, bool),
        "one_pass": lambda v: isinstance(v, bool),
        "array_order": lambda v: v is None or isinstance(v, str),
    }
    for key, ok in checks.items():
        if key in state and not ok(state[key]):
            return f"{key} has a value of the wrong type or range: {state[key]!r}"
    when = state.get("time", 0.0)
    if not (isinstance(when, (int, float)) and not isinstance(when, bool)
            and math.isfinite(when) and when >= 0):
        return f"time {when!r} is not a moment (seconds since 1970, finite and >= 0)"
    return _position_problem(state)


def _position_problem(state):
    """What makes the position's numbers, each of the right type and range,
    one that no run writes, or None. What a run writes (loop/main_loop.py,
    loop/fit_steps.py, ResumeState.on_towers):

    - local_step counts the steps of epoch epoch_num: at most global_step,
      and at most steps_per_epoch where the epoch length is known;
    - epoch_num is 0 only before the first step; every epoch before the
      current one took a step, but for those fit's initial_epoch skips;
    - tower_batches holds one count per tower (or none); when an epoch is
      one pass, each tower took at most one batch a step of it (a resume
      on other towers sets local_step to the steps its position is worth);
      else each step took a batch per tower, and a resume on fewer towers
      or smaller batches carries the position in the new batches, so the
      counts sum to at most MAX_TOWERS batches a step.
    """
    epoch, local, step = state["epoch_num"], state["local_step"], state["global_step"]
    towers = state.get("num_towers")
    if towers is not None and towers > MAX_TOWERS:
        return f"num_towers {towers} is more than any run's towers (at most {MAX_TOWERS})"
    if local > step:
        return (f"local_step {local} is more than global_step {step} (steps of the epoch "
                "are steps in all)")
    length = state.get("steps_per_epoch")
    if length is not None and local > length:
        return f"local_step {local} is more than steps_per_epoch {length}"
    if epoch == 0 and step > 0:
        return f"epoch_num 0 after {step} steps (steps are taken in epochs 1 and on)"
    if epoch > step + 1 + MAX_STEPLESS_EPOCHS:
        return (f"epoch_num {epoch} is beyond global_step {step}: every epoch takes a step, "
                f"but for at most {MAX_STEPLESS_EPOCHS} that fit's initial_epoch skips")
    batches = state.get("tower_batches", [])
    if towers is not None and batches and len(batches) != towers:
        return (f"tower_batches holds {len(batches)} counts for num_towers={towers} "
                f"(one a tower): {batches!r}")
    if state.get("one_pass", False):
        if batches and max(batches) > local:
            return (f"tower_batches {batches!r} is more than the {local} step(s) taken in "
                    f"the pass (local_step): a tower takes at most a batch a step")
    elif sum(batches) > step * MAX_TOWERS:
        return (f"tower_batches {batches!r} ({sum(batches)} batches in all) is more than "
                f"global_step {step} steps take (at most {MAX_TOWERS} batches a step)")
    return None


def state_manifest_problem(state, manifest):
    """What is wrong with state.json's step against manifest.json's, or None."""
    if state.get("global_step") != manifest.get("global_step"):
        return (f"global_step {state.get('global_step')!r} is not the manifest's "
                f"{manifest.get('global_step')!r}")
    return None


def npz_problem(file):
    """Why the .npz archive at `file` could not be variables, or None: each
    member must be a .npy array of numbers (no object arrays, which numpy
    would unpickle)."""
    try:
        with zipfile.ZipFile(file) as archive:
            for member in archive.namelist():
                if not member.endswith(".npy"):
                    return f"it holds {member!r}, which is not a .npy array"
                with archive.open(member) as f:
                    version = np.lib.format.read_magic(f)
                    header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                              else np.lib.format.read_array_header_2_0)
                    _, _, dtype = header(f)
                if dtype.hasobject:
                    return f"{member!r} is an array of Python objects"
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        return f"it cannot be read ({type(error).__name__}: {error})"
    return None
