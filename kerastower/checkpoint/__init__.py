"""Checkpoints: what one holds, written so that a kill never leaves it half-written.

The modules: `store.py` writes, lists and verifies checkpoint folders
(`kt.checkpoint.*`); `restore.py` reads one back into a model; `files.py` the atomic, checksummed files and
manifest; `trust.py` the checks of every field a reader uses; `keys.py`
each variable's key; `places.py` where each automatically named layer
sits; `variables.py` the variables' file, the same on every backend;
`resume_state.py` the loop position a resume goes on from;
`training_state.py` which variables a run carries; `folder_lock.py` one
run per folder.

A checkpoint is a folder `ckpt-<global_step>` inside the checkpoint directory:

    ckpt-00000120/
        variables.npz   (`np.savez`, on every backend: kerastower/checkpoint/variables.py)
                        every variable a run carries, each under its key
                        (kerastower/checkpoint/keys.py): the model's
                        (seed-generator states included) and every
                        optimizer's (slots, step counters)
        state.json      loop state and input position (kerastower/checkpoint/resume_state.py)
        manifest.json   size and sha256 of every file above; per variable its
                        key, Keras path, shape, dtype, whether all its
                        values were finite and, for a layer Keras named,
                        its place in the model; retention data (ModelSaver); and
                        a sha256 of the manifest itself

It is written under a temporary name, fsynced, and renamed into place
(kerastower/checkpoint/files.py). A checkpoint counts only when its manifest
is there and verifies: every file has the size and sha256 it lists, and
every variable was finite. A checkpoint whose variables hold NaN or Inf is
never written.

Restoring matches variables by key, so reordering layers in the code loads
each weight where it belongs. Where a key names a layer Keras named itself
(`dense_1`) and that name now belongs to a layer at another place (created
in another order), the restore goes by place, with a warning, where the
places match one for one, and refuses otherwise: it never swaps weights
(kerastower/checkpoint/places.py). Variables the model has and the checkpoint
lacks, the other way round, or of another shape or dtype raise
`CheckpointMismatchError` listing them, unless `allow_partial=True`, which
restores the rest and warns about them.

One exception to "the same dtype": an integer variable saved as another
integer dtype of the same shape is restored with a cast to the model's
dtype when every value fits it (checked against its minimum and maximum);
a value that does not fit is a mismatch naming the key, both dtypes and the
value (`CheckpointMismatchError.out_of_range`). This is what lets a
checkpoint written on TensorFlow resume on JAX and the other way round: the
optimizer's step counter (`optimizer/adam/iteration`, say) is int64 on TensorFlow
and int32 on JAX, a seed generator's state (`model/<layer>/seed_generator_state`)
int64 on TensorFlow and uint32 on JAX. Float dtypes must match exactly
(float16 against float32 is a mismatch). Manifests name dtypes the same
way on both backends ("float32", "int64", "bfloat16").

Checkpoints written on TensorFlow by older kerastower versions hold
`variables.index` and `variables.data-*` (TensorFlow's format) instead of
`variables.npz`; they are still read where TensorFlow can be imported, and
where it cannot, reading one raises a KerasTowerError saying TensorFlow is
needed (kerastower/checkpoint/variables.py).

Examples:
    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> inputs = keras.Input((3,))
    >>> model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> _ = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0,
    ...               callbacks=[kt.callbacks.ModelSaver(folder)])
    >>> os.path.basename(kt.checkpoint.latest_checkpoint(folder))
    'ckpt-00000002'
"""

from kerastower.checkpoint.restore import CheckpointMismatchError
from kerastower.checkpoint.restore import read_checkpoint
from kerastower.checkpoint.restore import restore_latest
from kerastower.checkpoint.store import DamagedCheckpointError
from kerastower.checkpoint.store import NonFiniteCheckpointError
from kerastower.checkpoint.store import clean_up
from kerastower.checkpoint.store import latest_checkpoint
from kerastower.checkpoint.store import list_checkpoints
from kerastower.checkpoint.store import verify_checkpoint
from kerastower.checkpoint.store import write_checkpoint

__all__ = [
    "write_checkpoint", "read_checkpoint", "restore_latest", "list_checkpoints",
    "latest_checkpoint", "verify_checkpoint", "clean_up", "DamagedCheckpointError",
    "NonFiniteCheckpointError", "CheckpointMismatchError",
]
