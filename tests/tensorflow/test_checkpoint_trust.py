"""A checkpoint folder is data, never code: forged manifests and states are damaged checkpoints.

Each forgery is re-signed (the manifest's own checksum and the files'
digests made to match), as a hostile or buggy writer would, so that only the
field checks can catch it; each is skipped, with its reason, for the older
intact checkpoint.
"""

import json
import os

import keras
import numpy as np
import pytest

import kerastower as kt
from kerastower.checkpoint import files as checkpoint_files


@pytest.fixture
def two_checkpoints(tmp_path):
    """A folder with the checkpoints of global steps 4 and 8."""
    folder = str(tmp_path / "ckpt")
    inputs = keras.Input((3,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((16, 3)), np.ones((16, 1)), batch_size=4, epochs=2, verbose=0,
              callbacks=[kt.callbacks.ModelSaver(folder)])
    assert [s for s, _ in kt.checkpoint.list_checkpoints(folder)] == [4, 8]
    return folder, model


def _resign(path, change_manifest=None):
    """Re-digests every file the manifest lists and re-signs the manifest."""
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    fields = {k: v for k, v in manifest.items() if k != "checksum"}
    for name in list(fields["files"]):
        file = os.path.join(path, name)
        if os.path.isfile(file) and not os.path.islink(file):
            fields["files"][name] = checkpoint_files._digest(file)
    if change_manifest is not None:
        change_manifest(fields)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(dict(fields, checksum=checkpoint_files._self_checksum(fields)), f)


def _edit_state(path, **changes):
    with open(os.path.join(path, "state.json")) as f:
        state = json.load(f)
    with open(os.path.join(path, "state.json"), "w") as f:
        json.dump(dict(state, **changes), f)
    _resign(path)


def _path_traversal(path):
    secret = os.path.join(os.path.dirname(os.path.dirname(path)), "secret.txt")
    with open(secret, "w") as f:
        f.write("not yours")
    relative = os.path.relpath(secret, path)
    _resign(path, lambda fields: fields["files"].update(
        {relative: checkpoint_files._digest(secret)}))
    return "leaves the checkpoint folder"


def _files_as_a_list(path):
    _resign(path, lambda fields: fields.update(files=sorted(fields["files"])))
    return "files must map file names"


def _string_step(path):
    _edit_state(path, global_step="8")
    return "global_step must be an integer >= 0, got '8'"


def _negative_tower_batches(path):
    _edit_state(path, tower_batches=[-3, 1])
    return "tower_batches has a value of the wrong type or range"


def _object_array(path):
    with np.load(os.path.join(path, "variables.npz")) as stored:
        values = {key: stored[key] for key in stored.files}
    first = sorted(values)[0]
    values[first] = np.array([{"pickled": "code"}], dtype=object)
    with open(os.path.join(path, "variables.npz"), "wb") as f:
        np.savez(f, **values)
    _resign(path)
    return "an array of Python objects"


def _symlinked_file(path):
    target = os.path.join(os.path.dirname(os.path.dirname(path)), "elsewhere.json")
    os.replace(os.path.join(path, "state.json"), target)
    os.symlink(target, os.path.join(path, "state.json"))
    return "state.json is a symbolic link"


def _variables_entry(path):
    _resign(path, lambda fields: fields["variables"][0].update(shape="(3, 1)"))
    return "each variables entry needs a key, a dtype, a shape of integers"


def _optimizers_entry(path):
    _resign(path, lambda fields: fields.update(optimizers={"d_optimizer": [["model", "dense"]]}))
    return "optimizers must map each optimizer's attribute to the keys"


# Numbers of the right type, out of every run's reach or inconsistent with
# one another (the fixture's newest state: epoch 2 ended, local_step 4 of
# steps_per_epoch 4, global_step 8, one tower, tower_batches [4], one pass).
def _a_billion_tower_batches(path):
    _edit_state(path, tower_batches=[10**9])  # an endless pipeline would skip a billion
    return "tower_batches [1000000000]"


def _tower_batches_beyond_the_pass(path):
    _edit_state(path, tower_batches=[5])
    return "tower_batches [5]"


def _tower_batches_of_steps_beyond_the_global_step(path):
    _edit_state(path, one_pass=False, tower_batches=[8 * 65536 + 1])
    return "tower_batches [524289]"


def _tower_batches_of_another_number_of_towers(path):
    _edit_state(path, tower_batches=[2, 2])
    return "tower_batches holds 2 counts for num_towers=1"


def _global_step_2_63(path):
    _edit_state(path, global_step=2**63)
    return "global_step 9223372036854775808"


def _global_step_unlike_the_manifest(path):
    _edit_state(path, global_step=9)
    return "global_step 9 is not the manifest's 8"


def _epoch_num_1e9(path):
    _edit_state(path, epoch_num=10**9)
    return "epoch_num 1000000000"


def _epoch_num_0_after_steps(path):
    _edit_state(path, epoch_num=0)
    return "epoch_num 0"


def _local_step_beyond_global_step(path):
    _edit_state(path, local_step=9, steps_per_epoch=None, one_pass=True)
    return "local_step 9 is more than global_step 8"


def _local_step_beyond_the_epoch(path):
    _edit_state(path, local_step=5)
    return "local_step 5 is more than steps_per_epoch 4"


def _a_million_towers(path):
    _edit_state(path, num_towers=2**20, tower_batches=[])
    return "num_towers 1048576"


def _time_not_a_number(path):
    _edit_state(path, time=float("nan"))
    return "time nan"


@pytest.mark.parametrize("forge", [
    _path_traversal, _files_as_a_list, _string_step, _negative_tower_batches, _object_array,
    _symlinked_file, _variables_entry, _optimizers_entry,
    _a_billion_tower_batches, _tower_batches_beyond_the_pass,
    _tower_batches_of_steps_beyond_the_global_step, _tower_batches_of_another_number_of_towers,
    _global_step_2_63, _global_step_unlike_the_manifest, _epoch_num_1e9, _epoch_num_0_after_steps,
    _local_step_beyond_global_step, _local_step_beyond_the_epoch, _a_million_towers,
    _time_not_a_number,
], ids=lambda forge: forge.__name__.strip("_"))
def test_a_forged_checkpoint_is_skipped_naming_the_field(two_checkpoints, forge):
    folder, model = two_checkpoints
    newest = kt.checkpoint.latest_checkpoint(folder)
    reason = forge(newest)
    if getattr(forge, "found_by", "verify") == "verify":
        with pytest.raises(kt.checkpoint.DamagedCheckpointError, match="cannot be used") as caught:
            kt.checkpoint.verify_checkpoint(newest)
        assert reason in caught.value.reason
    with pytest.raises(kt.checkpoint.DamagedCheckpointError, match="cannot be used") as caught:
        kt.checkpoint.read_checkpoint(newest, model)
    assert reason in caught.value.reason
    with pytest.warns(UserWarning, match="skipping the checkpoint") as warned:
        path, state = kt.checkpoint.restore_latest(folder, model)
    assert path.endswith("ckpt-00000004") and state["global_step"] == 4
    assert any(reason in str(w.message) for w in warned)


def test_the_states_runs_write_pass_the_checks():
    """Legitimate positions, elastic moves included, are not refused."""
    from kerastower.checkpoint.trust import state_problem
    required = ("epoch_num", "local_step", "global_step")
    fine = [
        {"epoch_num": 1, "local_step": 7, "global_step": 7},           # write_checkpoint's doc
        {"epoch_num": 0, "local_step": 0, "global_step": 0, "tower_batches": []},
        {"epoch_num": 1001, "local_step": 3, "global_step": 3, "steps_per_epoch": 5,
         "num_towers": 2, "tower_batches": [3, 3]},                     # fit(initial_epoch=1000)
        # 4 towers resumed on 1 (an endless input): the position is carried in batches.
        {"epoch_num": 2, "local_step": 1, "global_step": 11, "steps_per_epoch": 10,
         "num_towers": 1, "tower_batches": [41], "one_pass": False},
        # arrays: batch 64 resumed as batch 1 mid-pass, one pass: the step is the position.
        {"epoch_num": 1, "local_step": 640, "global_step": 640, "steps_per_epoch": 1000,
         "num_towers": 1, "tower_batches": [640], "one_pass": True, "batch_size": 1},
        # the last step of a pass that did not fill every tower
        {"epoch_num": 3, "local_step": 3, "global_step": 9, "steps_per_epoch": 3,
         "num_towers": 2, "tower_batches": [3, 2], "one_pass": True, "epoch_ended": True},
    ]
    for state in fine:
        assert state_problem(state, required) is None, state


def test_a_forged_input_position_of_an_endless_input_is_skipped_not_skipped_through(tmp_path):
    """The next launch after a state.json with a billion tower batches: the
    checkpoint before it, at once, not a billion batches read and dropped."""
    folder = str(tmp_path / "ckpt")

    def endless():
        while True:
            yield np.ones((4, 3), "float32"), np.ones((4, 1), "float32")

    def launch(epochs):
        inputs = keras.Input((3,))
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="sgd", loss="mse")
        model.fit(endless(), steps_per_epoch=2, epochs=epochs, verbose=0, callbacks=[
            kt.callbacks.ModelSaver(folder), kt.callbacks.AutoResume(folder)])
        return model

    launch(2)
    newest = kt.checkpoint.latest_checkpoint(folder)
    assert newest.endswith("ckpt-00000004")
    _edit_state(newest, tower_batches=[10**9])
    with pytest.warns(UserWarning, match=r"skipping the checkpoint .*ckpt-00000004: .*tower_batches"):
        model = launch(3)
    assert model.loop.global_step == 6   # from step 2 (epoch 1's end): epochs 2 and 3


def _fit_with(*callbacks):
    inputs = keras.Input((3,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0, callbacks=list(callbacks))


def test_a_checkpoint_path_that_is_a_file_is_named_at_start(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("a file the user keeps")
    with pytest.raises(kt.KerasTowerError, match=r"ModelSaver: the checkpoint folder .*ckpt' is a file"):
        _fit_with(kt.callbacks.ModelSaver(str(path)))
    with pytest.raises(kt.KerasTowerError, match=r"AutoResume: the checkpoint folder .*ckpt' is a file"):
        _fit_with(kt.callbacks.AutoResume(str(path)))
    assert path.read_text() == "a file the user keeps"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder: no unwritable folder to make")
def test_an_unwritable_checkpoint_folder_is_named_at_start(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(kt.KerasTowerError, match="cannot write into its checkpoint folder"):
            _fit_with(kt.callbacks.ModelSaver(str(folder)))
    finally:
        folder.chmod(0o700)


def _auto_named_pair(applied_first):
    """Two Dense layers of one shape, named by Keras in creation order;
    `applied_first` says which of the two the input goes through first."""
    keras.utils.set_random_seed(3)
    layers = [keras.layers.Dense(3), keras.layers.Dense(3)]
    inputs = keras.Input((3,))
    first, second = layers[applied_first], layers[1 - applied_first]
    model = kt.TowerModel(inputs, second(keras.layers.Dropout(0.0)(first(inputs))))
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 3)), np.ones((8, 3)), batch_size=4, verbose=0)
    return model


def test_auto_named_layers_created_in_another_order_restore_by_place_and_say_so(tmp_path):
    saved = _auto_named_pair(applied_first=0)
    path = kt.checkpoint.write_checkpoint(str(tmp_path), saved, STATE)
    swapped = _auto_named_pair(applied_first=1)   # the same graph; the names traded
    # By key alone (dense, dense_1), each layer would take the other's weights.
    with pytest.warns(UserWarning, match=r"by place: layers Keras named .*\(dense is now "
                                         r"dense_1, dense_1 is now dense\)"):
        kt.checkpoint.read_checkpoint(path, swapped)
    for a, b in zip(saved.get_weights(), swapped.get_weights()):   # graph order: by place
        np.testing.assert_array_equal(a, b)
    # The optimizer's slots, built in the graph's order on both, follow their layers.
    for a, b in zip(saved.optimizer.variables, swapped.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=b.path)


class TwoDense(kt.TowerModel):
    """Two auto-named Dense layers held as `names` (created in that order),
    the input going through `names[order[0]]` first."""

    def __init__(self, names, order):
        super().__init__()
        for name in names:
            setattr(self, name, keras.layers.Dense(3))
        self.order = [names[i] for i in order]

    def call(self, x):
        return getattr(self, self.order[1])(getattr(self, self.order[0])(x))


def _pair(names, order):
    keras.utils.set_random_seed(3)
    model = TwoDense(names, order)
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 3)), np.ones((8, 3)), batch_size=4, verbose=0)
    return model


def test_auto_named_layers_whose_places_cannot_be_matched_are_refused_naming_them(tmp_path):
    saved = _pair(["encoder", "decoder"], [0, 1])
    path = kt.checkpoint.write_checkpoint(str(tmp_path), saved, STATE)
    # Renamed attributes, created in the other order: the names traded, and
    # no place of the checkpoint is found here to say which layer is which.
    changed = _pair(["dec", "enc"], [1, 0])
    before = [w.copy() for w in changed.get_weights()]
    with pytest.raises(kt.checkpoint.CheckpointMismatchError, match="trade their automatic names") as caught:
        kt.checkpoint.read_checkpoint(path, changed)
    assert "was saved from the layer at encoder, here it is the layer at dec" in str(caught.value)
    assert "name='encoder'" in str(caught.value)
    for a, b in zip(before, changed.get_weights()):
        np.testing.assert_array_equal(a, b)   # nothing was swapped
    same = _pair(["encoder", "decoder"], [0, 1])   # the same code restores as before
    kt.checkpoint.read_checkpoint(path, same)
    for a, b in zip(saved.get_weights(), same.get_weights()):
        np.testing.assert_array_equal(a, b)


STATE = {"epoch_num": 1, "local_step": 2, "global_step": 2}
