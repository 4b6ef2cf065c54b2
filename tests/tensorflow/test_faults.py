"""Fault injection: real kills, damaged files, NaN weights, reordered layers,
restarts. Checkpoints must lose nothing and never restore the wrong thing."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest

import kerastower as kt
from tests.tensorflow.helpers import TWO
from kerastower.checkpoint import files as checkpoint_files
from kerastower.checkpoint.keys import keyed_variables

# Its module-scoped fixture starts processes once: one pytest-xdist worker runs the module.
pytestmark = pytest.mark.xdist_group("test_faults")

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "faults_script.py")
STEPS = 50  # faults_script.py: 10 epochs of 5 steps


# -- 20 SIGKILLs at random moments, then a bit-equal end -------------------------

def _step_of(path):
    return None if path in (None, "None") else int(re.search(r"ckpt-(\d+)", path).group(1))


class Lives:
    """faults_script.py --zygote: one process that imported TensorFlow,
    forking a fresh process for each run, so that a life costs no import."""

    def __init__(self, log):
        self.log = log
        self.stderr = open(log, "w")
        self.process = subprocess.Popen([sys.executable, SCRIPT, "--zygote"], text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.stderr)
        self.watchdog = threading.Timer(600, self.process.kill)
        self.watchdog.start()

    def close(self):
        self.watchdog.cancel()
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.stderr.close()

    def run(self, ckpt_dir, out, kill):
        """One life; `kill` is None, ("hook", spec) or ("timer", k, delay):
        SIGKILL `delay` s after it reported its k-th save (0: after it
        reported where it resumed from). Returns (the step it resumed from,
        the last step it reported saved, its exit status)."""
        spec = kill[1] if kill and kill[0] == "hook" else "-"
        self.process.stdin.write(f"{ckpt_dir} {out} {spec}\n")
        self.process.stdin.flush()
        pid, resumed, saved, saves, due = None, "unset", 0, 0, False
        for line in self.process.stdout:
            word, _, rest = line.strip().partition(" ")
            if word == "pid":
                pid = int(rest)
            elif word == "exit":
                status = int(rest)
                break
            elif word == "resumed":
                resumed = rest.split()[-1]
            elif word == "saved":
                saved, saves = int(rest), saves + 1
            due = due or (kill is not None and kill[0] == "timer" and resumed != "unset"
                          and saves == kill[1])
            if due and pid is not None:
                time.sleep(kill[2])
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:  # it ended first: "not killed" below says so
                    pass
                due, kill = False, None
        else:
            raise AssertionError(f"the zygote died: {open(self.log).read()[-3000:]}")
        assert resumed != "unset", open(self.log).read()[-3000:]
        return _step_of(resumed), saved, status


def _plan(rng, resume, index):
    """The next kill: even lives are killed from inside a save (at a random
    file-system event, sometimes in an epoch end's same-step replace), odd
    ones from outside at a random moment after a random step."""
    start = resume or 0
    if index % 2 == 0:
        epoch_end = (start // 5 + 1) * 5
        if rng.random() < 0.4 and epoch_end <= start + 5:
            return ("hook", f"{epoch_end}:2:{rng.integers(1, 13)}")   # 12 events in a replace
        return ("hook", f"{start + rng.integers(1, 3)}:1:{rng.integers(1, 8)}")  # 7 in a save
    return ("timer", int(rng.integers(0, 3)), float(rng.uniform(0.0, 0.15)))


def _assert_all_intact(ckpt_dir, context):
    for _, path in kt.checkpoint.list_checkpoints(ckpt_dir):
        try:
            kt.checkpoint.verify_checkpoint(path)
        except kt.checkpoint.DamagedCheckpointError as error:
            raise AssertionError(f"{context}: {error}") from None


def _chain(lives, tmp_path, name, kills, seed, report, stop):
    rng = np.random.default_rng(seed)
    ckpt_dir, out = str(tmp_path / name), str(tmp_path / f"{name}.npz")
    resume = None
    for index in range(kills + 1):
        if stop.is_set():  # the other chain failed
            return None
        kill = _plan(rng, resume, index) if index < kills else None
        context = f"{name} life {index}, kill {kill}, resuming from step {resume}"
        resumed, saved, rc = lives.run(ckpt_dir, out, kill)
        report.append(context)
        assert resumed == resume, f"{context}: resumed from {resumed}"
        if kill is None:
            assert rc == 0, f"{context}: exit status {rc}, see {lives.log}"
            break
        assert rc == -signal.SIGKILL, f"{context}: not killed (rc {rc}, last saved {saved})"
        assert not os.path.exists(out)
        _assert_all_intact(ckpt_dir, context)
        newest = _step_of(kt.checkpoint.latest_checkpoint(ckpt_dir))
        assert (newest or 0) >= saved, f"{context}: {saved} was saved, the newest intact is {newest}"
        resume = newest
    leftovers = [n for n in os.listdir(ckpt_dir) if not re.fullmatch(r"ckpt-\d+", n)]
    assert leftovers == [], f"{name}: killed saves left {leftovers} after a restart"
    _assert_all_intact(ckpt_dir, name)
    return out


def test_twenty_sigkills_at_random_moments_then_the_weights_are_bit_equal(tmp_path):
    """Two chains of 10 kills each run side by side (they share nothing),
    the first after an uninterrupted run; every restart resumes from the
    newest checkpoint, none is ever damaged, and both chains end bit-equal
    to the uninterrupted run."""
    results, errors, report, stop = {}, [], [], threading.Event()

    def uninterrupted_then_chain(lives):
        resumed, saved, rc = lives.run(str(tmp_path / "whole"), str(tmp_path / "whole.npz"), None)
        assert rc == 0 and resumed is None and saved == STEPS, f"exit status {rc}, see {lives.log}"
        results["whole"] = str(tmp_path / "whole.npz")
        return _chain(lives, tmp_path, "a", 10, 1, report, stop)

    def run(key, fn, *args):
        lives = Lives(str(tmp_path / f"zygote-{key}.log"))
        try:
            results[key] = fn(lives, *args)
        except BaseException as error:  # reported by the main thread
            errors.append((key, error))
            stop.set()
        finally:
            lives.close()

    threads = [
        threading.Thread(target=run, args=("a", uninterrupted_then_chain)),
        threading.Thread(target=run, args=("b", _chain, tmp_path, "b", 10, 2, report, stop)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise AssertionError(f"{errors[0][0]}: {errors[0][1]}\nlives: {report}") from errors[0][1]
    assert sum("kill None" not in line for line in report) == 20, report
    print("\n".join(report))  # shown with pytest -s: where each life was killed
    whole = np.load(results["whole"])
    for chain in ("a", "b"):
        resumed = np.load(results[chain])
        assert int(resumed["step"]) == int(whole["step"]) == STEPS
        for key in whole.files:
            np.testing.assert_array_equal(resumed[key], whole[key], err_msg=f"chain {chain}: {key}")


# -- damaged checkpoints: fall back, or say which and why -------------------------

def _model(hidden_name="hidden"):
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, activation="tanh", name=hidden_name)(inputs)
    h = keras.layers.Dropout(0.2, name="drop")(h)
    model = kt.TowerModel(inputs, keras.layers.Dense(3, name="logits")(h))
    model.compile(optimizer=keras.optimizers.Adam(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(48, 4)).astype("float32")
    return x, rng.integers(0, 3, 48).astype("int32")


class AtBegin(keras.callbacks.Callback):
    """Keeps the weights the run starts from (after AutoResume restored them)."""

    def on_train_begin(self, logs=None):
        self.weights = {path: v.numpy() for _, path, v in keyed_variables(self.model)}


def _fit(ckpt_dir, *callbacks, epochs=2, resume=True, **resume_kwargs):
    x, y = _data()
    model = _model()
    begin = AtBegin()
    auto = kt.callbacks.AutoResume(ckpt_dir, **resume_kwargs) if resume else None
    model.fit(x, y, batch_size=4, steps_per_epoch=3, epochs=epochs, verbose=0,
              callbacks=[c for c in (auto, begin, *callbacks) if c is not None])
    return model, auto, begin


def _saved_values(path):
    keys = [v["key"] for v in kt.checkpoint.verify_checkpoint(path)["variables"]]
    with np.load(os.path.join(path, "variables.npz")) as stored:
        return {key: stored[key] for key in keys}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Checkpoints at steps 2, 4, 6 of a two-tower run."""
    directory = str(tmp_path_factory.mktemp("trained") / "ckpt")
    with kt.distributed("mirrored", devices=TWO):
        keras.utils.set_random_seed(5)
        _fit(directory, kt.callbacks.PeriodicTrigger(
            kt.callbacks.ModelSaver(directory, max_to_keep=None), every_k_steps=2), resume=False)
    assert [s for s, _ in kt.checkpoint.list_checkpoints(directory)] == [2, 4, 6]
    return directory


@pytest.fixture
def ckpt(trained, tmp_path):
    copy = str(tmp_path / "ckpt")
    shutil.copytree(trained, copy)
    return copy


def _file(ckpt_dir, step, name):
    return os.path.join(ckpt_dir, f"ckpt-{step:08d}", name)


DATA = "variables.npz"


def _damage(ckpt_dir, step, how):
    if how == "truncated":
        with open(_file(ckpt_dir, step, DATA), "r+b") as f:
            f.truncate(os.path.getsize(f.name) // 2)
    elif how == "no manifest":
        os.remove(_file(ckpt_dir, step, "manifest.json"))
    elif how in ("flipped", "flipped state"):
        name = DATA if how == "flipped" else "state.json"
        with open(_file(ckpt_dir, step, name), "r+b") as f:
            f.seek(os.path.getsize(f.name) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x01]))
    elif how == "edited manifest":
        path = _file(ckpt_dir, step, "manifest.json")
        with open(path) as f:
            manifest = json.load(f)
        manifest["variables"][0]["shape"] = [99]
        with open(path, "w") as f:
            json.dump(manifest, f)


REASONS = {
    "truncated": f"truncated file {DATA}",
    "no manifest": "missing manifest.json",
    "flipped": f"checksum mismatch in {DATA}",
    "flipped state": "checksum mismatch in state.json",
    "edited manifest": "checksum mismatch in manifest.json itself",
}


@pytest.mark.parametrize("how", list(REASONS))
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(two_towers, ckpt, how):
    _damage(ckpt, 6, how)
    previous = _saved_values(os.path.join(ckpt, "ckpt-00000004"))
    with pytest.warns(UserWarning, match=re.escape(f"ckpt-00000006: {REASONS[how]}")):
        model, auto, begin = _fit(ckpt, epochs=3)
    assert auto.restored_from.endswith("ckpt-00000004")
    assert model.loop.global_step == 9  # from step 4 to the end of epoch 3
    by_path = {path: key for key, path, _ in keyed_variables(model)}
    for path, value in begin.weights.items():
        np.testing.assert_array_equal(value, previous[by_path[path]], err_msg=path)


def test_every_checkpoint_damaged_raises_naming_each_and_why(two_towers, ckpt):
    for step, how in ((2, "no manifest"), (4, "flipped"), (6, "truncated")):
        _damage(ckpt, step, how)
    with pytest.warns(UserWarning), pytest.raises(kt.errors.KerasTowerError) as error:
        _fit(ckpt)
    message = str(error.value)
    for step, how in ((2, "no manifest"), (4, "flipped"), (6, "truncated")):
        assert f"{_file(ckpt, step, '')[:-1]}: {REASONS[how]}" in message, message


def test_stale_temporary_folders_are_removed_at_start_up(two_towers, ckpt):
    for stale in (".writing-killed", ".deleting-ckpt-00000001-x"):
        os.makedirs(os.path.join(ckpt, stale, "variables"))
    _fit(ckpt, epochs=2)  # AutoResume alone
    assert sorted(os.listdir(ckpt)) == ["ckpt-00000002", "ckpt-00000004", "ckpt-00000006"]
    os.makedirs(os.path.join(ckpt, ".writing-killed"))
    _fit(ckpt, kt.callbacks.ModelSaver(ckpt), epochs=1, resume=False)  # ModelSaver alone
    assert ".writing-killed" not in os.listdir(ckpt)


def test_a_same_step_replace_has_a_complete_checkpoint_at_every_moment(two_towers, ckpt, monkeypatch):
    model, _, _ = _fit(ckpt, epochs=2)  # restored at step 6, nothing left to train
    model.get_layer("hidden").kernel.assign(np.full((4, 6), 0.5, "float32"))
    seen, inside = [], []

    def watched(original):
        def call(*args, **kwargs):
            if not inside:  # verifying reads files and fsyncs: do not recurse
                inside.append(True)
                names = tuple(sorted(os.listdir(ckpt)))
                newest = kt.checkpoint.latest_checkpoint(ckpt)
                seen.append((names, newest))
                inside.clear()
                assert newest is not None and _step_of(newest) == 6, names
            return original(*args, **kwargs)
        return call

    for owner, name in ((os, "rename"), (os, "fsync"), (shutil, "rmtree")):
        monkeypatch.setattr(owner, name, watched(getattr(owner, name)))
    state = {"epoch_num": 2, "local_step": 3, "global_step": 6}
    path = kt.checkpoint.write_checkpoint(ckpt, model, state)
    monkeypatch.undo()
    assert any("ckpt-00000006.previous" in names for names, _ in seen)  # the old one, set aside
    assert any(newest.endswith(".previous") for _, newest in seen)
    assert sorted(os.listdir(ckpt)) == ["ckpt-00000002", "ckpt-00000004", "ckpt-00000006"]
    np.testing.assert_array_equal(_saved_values(path)["model/hidden/kernel"], np.full((4, 6), 0.5))


def test_a_replace_killed_between_its_renames_is_recovered(ckpt):
    # What a kill between "ckpt-N -> ckpt-N.previous" and "staging -> ckpt-N" leaves:
    os.rename(_file(ckpt, 6, "")[:-1], _file(ckpt, 6, "")[:-1] + ".previous")
    shutil.copytree(_file(ckpt, 4, "")[:-1], os.path.join(ckpt, ".writing-abc"))
    assert kt.checkpoint.latest_checkpoint(ckpt).endswith("ckpt-00000006.previous")
    kt.checkpoint.clean_up(ckpt)
    assert sorted(os.listdir(ckpt)) == ["ckpt-00000002", "ckpt-00000004", "ckpt-00000006"]
    # ... and between "staging -> ckpt-N" and removing ckpt-N.previous:
    shutil.copytree(_file(ckpt, 6, "")[:-1], _file(ckpt, 6, "")[:-1] + ".previous")
    kt.checkpoint.clean_up(ckpt)
    assert sorted(os.listdir(ckpt)) == ["ckpt-00000002", "ckpt-00000004", "ckpt-00000006"]
    kt.checkpoint.verify_checkpoint(_file(ckpt, 6, "")[:-1])


# -- NaN and Inf ---------------------------------------------------------------------

class PoisonAt(keras.callbacks.Callback):
    """Puts NaN into the hidden layer's kernel after global step `step`."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if self.model.loop.global_step == self.step:
            self.model.get_layer("hidden").kernel.assign(np.full((4, 6), np.nan, "float32"))


def test_model_saver_never_writes_nan_and_never_deletes_the_finite_ones(two_towers, tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    callbacks = [
        PoisonAt(5),
        kt.callbacks.PeriodicTrigger(kt.callbacks.ModelSaver(ckpt_dir, max_to_keep=2), every_k_steps=1),
        kt.callbacks.ModelSaver(ckpt_dir, max_to_keep=2),
        keras.callbacks.TerminateOnNaN(),
    ]
    refused = r"global step 5: 1 variable holds NaN or Inf \(model/hidden/kernel\)"
    with pytest.warns(UserWarning, match=refused):
        # Step 6 has NaN gradients: its update is skipped, and under
        # TerminateOnNaN fit ends normally.
        poisoned, _, _ = _fit(ckpt_dir, *callbacks, epochs=4, resume=False)
    assert poisoned.stop_training and poisoned.loop.global_step == 5
    assert sorted(os.listdir(ckpt_dir)) == ["ckpt-00000003", "ckpt-00000004"]
    for _, path in kt.checkpoint.list_checkpoints(ckpt_dir):
        assert all(v["finite"] for v in kt.checkpoint.verify_checkpoint(path)["variables"])
    _, auto, begin = _fit(ckpt_dir, epochs=2)
    assert auto.restored_from.endswith("ckpt-00000004")
    assert all(np.isfinite(value).all() for value in begin.weights.values() if value.dtype.kind == "f")


def _forge_nan(ckpt_dir, source_step, step, manifest_says_nan):
    """A checkpoint of `step` whose hidden kernel is NaN, as an older or
    buggy writer would leave it: intact files, the manifest's finite flag
    for it false (`manifest_says_nan`) or true."""
    source = _file(ckpt_dir, source_step, "")[:-1]
    manifest = kt.checkpoint.verify_checkpoint(source)
    values = _saved_values(source)
    values["model/hidden/kernel"] = np.full_like(values["model/hidden/kernel"], np.nan)
    with open(os.path.join(source, "state.json")) as f:
        state = dict(json.load(f), global_step=step)

    def fill(folder):
        with open(os.path.join(folder, "variables.npz"), "wb") as f:
            np.savez(f, **values)
        with open(os.path.join(folder, "state.json"), "w") as f:
            json.dump(state, f)

    variables = [dict(v, finite=not (manifest_says_nan and v["key"] == "model/hidden/kernel"))
                 for v in manifest["variables"]]
    checkpoint_files.commit(ckpt_dir, step, fill, {"variables": variables, "retention": {}})


@pytest.mark.parametrize("manifest_says_nan", [True, False], ids=["manifest-says-nan", "manifest-lies"])
def test_a_forged_nan_checkpoint_is_skipped_on_resume(two_towers, ckpt, manifest_says_nan):
    _forge_nan(ckpt, 6, 9, manifest_says_nan)
    with pytest.warns(UserWarning, match=r"ckpt-00000009: non-finite values \(NaN or Inf\)"):
        _, auto, begin = _fit(ckpt, epochs=3)
    assert auto.restored_from.endswith("ckpt-00000006")
    assert all(np.isfinite(value).all() for value in begin.weights.values() if value.dtype.kind == "f")


# -- restore by name -------------------------------------------------------------------

class TwoLayers(kt.TowerModel):
    """`first` then `second`, created in either order (`swap`); `second`
    may have another width and a `third` or `gone` layer may be added."""

    def __init__(self, swap=False, second_units=4, extra=None, **kwargs):
        super().__init__(**kwargs)
        if swap:
            self.second = keras.layers.Dense(second_units, name="second")
            self.first = keras.layers.Dense(4, name="first")
        else:
            self.first = keras.layers.Dense(4, name="first")
            self.second = keras.layers.Dense(second_units, name="second")
        self.extra = keras.layers.Dense(4, name=extra) if extra else None

    def call(self, x):
        h = self.first(x)
        if self.extra is not None:
            h = h + self.extra(x)
        return self.second(h)


def _two_layers(*callbacks, epochs=1, **kwargs):
    """A trained TwoLayers(**kwargs), after AutoResume etc. in `callbacks`."""
    model = TwoLayers(**kwargs)
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    model.fit(x, np.zeros((8, model.second.units), "float32"), batch_size=4, epochs=epochs,
              verbose=0, callbacks=list(callbacks))
    return model


STATE = {"epoch_num": 1, "local_step": 1, "global_step": 1}


def _slot(model, layer, slot):
    (variable,) = [v for v in model.optimizer.variables if v.path.endswith(f"{layer}_kernel_{slot}")]
    return variable.numpy()


def test_layers_created_in_another_order_are_restored_by_name(two_towers, tmp_path):
    saved = _two_layers()
    path = kt.checkpoint.write_checkpoint(str(tmp_path), saved, STATE)
    swapped = _two_layers(swap=True)
    assert [v.path.split("/")[1] for v in swapped.variables][:1] == ["second"]  # order differs
    kt.checkpoint.read_checkpoint(path, swapped)
    for name in ("first", "second"):
        for a, b in zip(getattr(saved, name).variables, getattr(swapped, name).variables):
            np.testing.assert_array_equal(b.numpy(), a.numpy(), err_msg=b.path)
        for slot in ("momentum", "velocity"):
            np.testing.assert_array_equal(_slot(swapped, name, slot), _slot(saved, name, slot))


def test_write_checkpoint_refuses_a_state_resume_could_not_read(two_towers, tmp_path):
    """A state without the loop's position would be written, then skipped as
    damaged by every reader: refused up front, naming what it lacks."""
    model = _two_layers()
    with pytest.raises(kt.errors.KerasTowerError, match=r"lacks \['epoch_num', 'local_step'\]"):
        kt.checkpoint.write_checkpoint(str(tmp_path), model, {"global_step": 7})
    assert kt.checkpoint.list_checkpoints(str(tmp_path)) == []
    with pytest.raises(kt.errors.KerasTowerError, match="JSON"):
        kt.checkpoint.write_checkpoint(str(tmp_path), model, dict(STATE, note=object()))
    assert os.listdir(tmp_path) == []


def test_missing_extra_and_reshaped_variables_are_listed_and_allow_partial(two_towers, tmp_path):
    saved = _two_layers(extra="gone")
    path = kt.checkpoint.write_checkpoint(str(tmp_path), saved, STATE)
    other = _two_layers(second_units=5, extra="third")
    before = other.second.kernel.numpy()
    with pytest.raises(kt.errors.KerasTowerError) as error:
        kt.checkpoint.read_checkpoint(path, other)
    message = str(error.value)
    assert "model/two_layers/third/kernel (4, 4)" in message.split("extra in")[0]  # missing
    assert "model/two_layers/gone/kernel (4, 4)" in message.split("extra in")[1]
    assert "model/two_layers/second/kernel saved (4, 4) float32, model (4, 5) float32" in message
    assert "optimizer/adam/two_layers/second/kernel/momentum" in message
    with pytest.warns(UserWarning, match="(?s)partial restore.*third/kernel"):
        kt.checkpoint.read_checkpoint(path, other, allow_partial=True)
    np.testing.assert_array_equal(other.first.kernel.numpy(), saved.first.kernel.numpy())
    np.testing.assert_array_equal(other.second.kernel.numpy(), before)  # not restored
    # The same through AutoResume, in fit (which builds the model first):
    with pytest.raises(kt.errors.KerasTowerError, match="does not fit this model"):
        _two_layers(kt.callbacks.AutoResume(str(tmp_path)), second_units=5, extra="third")
    partial, begin = kt.callbacks.AutoResume(str(tmp_path), allow_partial=True), AtBegin()
    with pytest.warns(UserWarning, match="(?s)partial restore.*third/kernel"):
        _two_layers(partial, begin, second_units=5, extra="third")
    assert partial.restored_from == path
    (first,) = [value for name, value in begin.weights.items() if name.endswith("/first/kernel")]
    np.testing.assert_array_equal(first, saved.first.kernel.numpy())


# -- retention across restarts -------------------------------------------------------------

def test_keep_every_n_hours_is_kept_across_a_restart(two_towers, tmp_path):
    """The clock says each step takes 15 minutes: with one checkpoint kept per
    hour, steps 4, 8, 12 are kept for good though a restart falls between,
    and though a second ModelSaver (at epoch ends, max_to_keep=1, replacing
    the first one's checkpoints) shares the directory."""
    ckpt_dir = str(tmp_path / "ckpt")

    def run(epochs):
        saver = kt.callbacks.ModelSaver(ckpt_dir, max_to_keep=1, keep_checkpoint_every_n_hours=1)
        saver.clock = lambda: 900.0 * saver.model.loop.global_step
        x, y = _data()
        model = _model()
        model.fit(x, y, batch_size=4, steps_per_epoch=2, epochs=epochs, verbose=0, callbacks=[
            kt.callbacks.AutoResume(ckpt_dir), kt.callbacks.PeriodicTrigger(saver, every_k_steps=1),
            kt.callbacks.ModelSaver(ckpt_dir, max_to_keep=1)])

    run(3)
    assert sorted(os.listdir(ckpt_dir)) == ["ckpt-00000004", "ckpt-00000006"]
    run(6)  # a new process would start here: new ModelSavers read the manifests
    assert sorted(os.listdir(ckpt_dir)) == ["ckpt-00000004", "ckpt-00000008", "ckpt-00000012"]
    retention = checkpoint_files.read_manifest(_file(ckpt_dir, 8, "")[:-1])["retention"]
    assert retention["kept_for_good"] and retention["last_kept_time"] == 7200.0


def test_retention_never_deletes_the_newest_intact_checkpoint(two_towers, ckpt):
    _damage(ckpt, 6, "flipped")
    _fit(ckpt, kt.callbacks.ModelSaver(ckpt, max_to_keep=1), epochs=1, resume=False)
    # Step 3 written; 4 is the newest intact one, kept; 6 is damaged, left alone.
    assert sorted(os.listdir(ckpt)) == ["ckpt-00000003", "ckpt-00000004", "ckpt-00000006"]
