"""Checkpoints that a kill can never leave half-written.

A checkpoint is a folder `ckpt-<global_step>` inside the checkpoint directory:

    ckpt-00000120/
        variables.index, variables.data-*   model variables (random-number
                                            states included) and the slots of
                                            every optimizer
        state.json                          loop state and input position

It is written under a temporary name and renamed into place, and only
folders holding `state.json` count, so a checkpoint is either whole or absent.
"""

import json
import os
import re
import shutil
import tempfile

import tensorflow as tf

from kerastower.errors import KerasTowerError
from kerastower.strategies import training_optimizers

__all__ = ["write_checkpoint", "read_checkpoint", "list_checkpoints", "latest_checkpoint"]

_NAME = re.compile(r"^ckpt-(\d+)$")
_STATE = "state.json"


def _trackable(model):
    # Explicit lists, matched by position: Keras's seed-generator states are
    # not in TensorFlow's object graph of the model.
    return tf.train.Checkpoint(
        model_variables=[v.value for v in model.variables],
        optimizer_variables=[
            v.value for optimizer in training_optimizers(model) for v in optimizer.variables
        ],
    )


def list_checkpoints(directory):
    """Complete checkpoints in `directory`, oldest first, as (step, path)."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = _NAME.match(name)
        path = os.path.join(directory, name)
        if match and os.path.isfile(os.path.join(path, _STATE)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(directory):
    """The path of the newest complete checkpoint in `directory`, or None."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def write_checkpoint(directory, model, state):
    """Writes the model, its optimizer and `state` (a JSON-able dict) as
    `ckpt-<global_step>`; returns its path."""
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, f"ckpt-{state['global_step']:08d}")
    staging = tempfile.mkdtemp(prefix=".writing-", dir=directory)
    try:
        _trackable(model).write(os.path.join(staging, "variables"))
        with open(os.path.join(staging, _STATE), "w") as f:
            json.dump(state, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def read_checkpoint(path, model):
    """Restores the model and optimizer from `path`; returns its state dict."""
    with open(os.path.join(path, _STATE)) as f:
        state = json.load(f)
    try:
        _trackable(model).read(os.path.join(path, "variables")).assert_consumed()
    except (AssertionError, ValueError, tf.errors.OpError) as error:
        raise KerasTowerError(
            f"The checkpoint {path} does not fit this model ({error}). It was "
            "written by a model with other layers or another optimizer; point "
            "the checkpoint directory elsewhere or build the same model."
        ) from None
    return state
