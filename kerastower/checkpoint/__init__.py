"""Checkpoints: what a checkpoint holds, written atomically, restored by name.

`store.py` writes, reads, lists and verifies checkpoint folders
(`kt.checkpoint.*`); `files.py` the atomic, checksummed files and manifest;
`keys.py` each variable's key; `variables.py` the variables per backend;
`resume_state.py` the loop position a resume goes on from;
`training_state.py` which variables a run carries.

Examples:
    >>> import os, tempfile, keras, numpy as np, kerastower as kt
    >>> folder = tempfile.mkdtemp()
    >>> inputs = keras.Input((3,))
    >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> _ = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0,
    ...               callbacks=[kt.callbacks.ModelSaver(folder)])
    >>> os.path.basename(kt.checkpoint.latest_checkpoint(folder))
    'ckpt-00000002'
"""

from kerastower.checkpoint.store import CheckpointMismatchError
from kerastower.checkpoint.store import DamagedCheckpointError
from kerastower.checkpoint.store import NonFiniteCheckpointError
from kerastower.checkpoint.store import clean_up
from kerastower.checkpoint.store import latest_checkpoint
from kerastower.checkpoint.store import list_checkpoints
from kerastower.checkpoint.store import read_checkpoint
from kerastower.checkpoint.store import restore_latest
from kerastower.checkpoint.store import verify_checkpoint
from kerastower.checkpoint.store import write_checkpoint

__all__ = [
    "write_checkpoint", "read_checkpoint", "restore_latest", "list_checkpoints",
    "latest_checkpoint", "verify_checkpoint", "clean_up", "DamagedCheckpointError",
    "NonFiniteCheckpointError", "CheckpointMismatchError",
]
