"""A preemption signal saves the step training was at; AutoResume goes on from it, bit-equal.

Real processes get real signals (tests/shared/preemption_script.py, on the
backend this suite runs on, each run forked by a zygote that imported the
backend once: tests/helpers/zygote.py); the in-process tests send the signal from a
callback, in pytest's main thread.
"""

import os
import signal
import time

import keras
import numpy as np
import pytest

from tests.helpers.common import BACKEND

import kerastower as kt

# Its module-scoped fixtures (runs other tests compare with) start once: one
# pytest-xdist worker runs the module.
pytestmark = pytest.mark.xdist_group("test_preemption")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preemption_script.py")


@pytest.fixture(scope="module")
def script(zygote):
    """preemption_script.py, each run a process that the zygote forks (no import to pay)."""
    return Script(zygote)


class Script:
    """Runs preemption_script.py: to its end (`run`) or paused at a step (`start`)."""

    def __init__(self, zygote):
        self.zygote = zygote

    def run(self, ckpt, out, *flags, ok=True):
        """Runs the script to its end; returns the finished run (`.stdout`, `.stderr`)."""
        done = self.zygote.run(SCRIPT, [ckpt, out, *flags], timeout=300,
                               output=f"{out}.stdout", errors=f"{out}.stderr")
        assert (done.returncode == 0) == ok, done.stdout[-2000:] + done.stderr[-3000:]
        return done

    def start(self, tmp_path, ckpt, name, *flags, pause_at=None):
        """Starts the script writing marks (and waiting after step `pause_at`
        until `go`); returns (the run, its marks folder)."""
        marks = tmp_path / f"marks-{name}"
        marks.mkdir()
        pause = [] if pause_at is None else ["--pause-at", pause_at]
        run = self.zygote.start(SCRIPT, [ckpt, tmp_path / f"{name}.npz", "--marks", marks, *pause,
                                         *flags], output=tmp_path / f"{name}.log")
        return run, marks


def wait_for(run, marks, mark):
    deadline = time.time() + 240
    while not (marks / mark).exists():
        assert run.poll() is None and time.time() < deadline, run.stdout[-3000:]
        time.sleep(0.05)


def go_on(marks):
    (marks / "go").touch()


def signal_at_step(script, tmp_path, ckpt, step, *flags, signum=signal.SIGTERM):
    """Starts the script, sends `signum` once step `step` has ended (the
    run waits there), and lets it go on; returns (exit status, output)."""
    run, marks = script.start(tmp_path, ckpt, ckpt.name, *flags, pause_at=step)
    wait_for(run, marks, f"step-{step}")
    run.send_signal(signum)
    go_on(marks)
    return run.wait(timeout=120), run.stdout


def assert_bit_equal(a_path, b_path, steps):
    a, b = np.load(a_path), np.load(b_path)
    assert int(a["step"]) == int(b["step"]) == steps
    for key in a.files:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, script):
    """The weights of the run never interrupted (3 epochs of 12 steps)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    script.run(folder / "ckpt", folder / "a.npz", "--dropout")
    return folder / "a.npz"


def test_sigterm_mid_epoch_saves_that_step_exits_75_and_resume_is_bit_equal(tmp_path, script,
                                                                             uninterrupted):
    ckpt = tmp_path / "ckpt"
    status, output = signal_at_step(script, tmp_path, ckpt, 5, "--dropout")
    assert status == 75, output[-3000:]
    assert "got SIGTERM; stopped after global step" in output, output[-3000:]
    saved = kt.checkpoint.latest_checkpoint(str(ckpt))
    step = kt.checkpoint.verify_checkpoint(saved)["global_step"]
    assert 5 <= step < 12  # mid-epoch: no epoch-end save has been written yet
    assert f"saved {saved}" in output
    resumed = script.run(ckpt, tmp_path / "b.npz", "--dropout")
    assert f"ckpt-{step:08d}" in resumed.stdout
    assert_bit_equal(uninterrupted, tmp_path / "b.npz", 36)


def test_a_second_signal_during_the_save_is_ignored_and_the_checkpoint_is_intact(tmp_path, script,
                                                                                 uninterrupted):
    ckpt = tmp_path / "ckpt"
    status, output = signal_at_step(script, tmp_path, ckpt, 3, "--dropout", "--signal-during-save")
    assert status == 75, output[-3000:]
    assert "1 more signal(s) during the save were ignored" in output, output[-3000:]
    kt.checkpoint.verify_checkpoint(kt.checkpoint.latest_checkpoint(str(ckpt)))
    script.run(ckpt, tmp_path / "b.npz", "--dropout")
    assert_bit_equal(uninterrupted, tmp_path / "b.npz", 36)


def _start_hung(script, tmp_path, ckpt, grace):
    """Starts the script (a checkpoint every 2 steps) whose step after global
    step 5 hangs inside the compiled step; returns the run once it hangs."""
    run, marks = script.start(tmp_path, ckpt, "hung", "--save-every", "2", "--hang-at", "5",
                              "--grace", grace)
    wait_for(run, marks, "hanging")
    # JAX dispatches a step ahead: the loop may finish one more before it waits.
    seen, still = set(os.listdir(marks)), time.time()
    while time.time() - still < 1.0:
        time.sleep(0.1)
        if set(os.listdir(marks)) != seen:
            seen, still = set(os.listdir(marks)), time.time()
    return run


def _ended(run, within):
    """(status, output, seconds) of a run that must end within `within` s."""
    start = time.time()
    try:
        status = run.wait(timeout=within)
    except TimeoutError:
        run.kill()
        raise AssertionError(f"still running {within} s later:\n{run.stdout[-3000:]}") from None
    return status, run.stdout, time.time() - start


def _assert_ended_on_the_last_checkpoint(ckpt, status, output):
    """Ended with 75 and the message, without a save: the newest checkpoint
    is the last every-2-steps one, it verifies, and the message names it."""
    import re

    assert status == 75, output[-3000:]
    assert "Exiting at once with status 75" in output, output[-3000:]
    # TensorFlow's loop waits in the step after 5; JAX's (a step dispatched
    # ahead) may have finished one more.
    stopped = int(re.search(r"training was interrupted after global step (\d+) \(epoch 1\)",
                            output).group(1))
    assert stopped == 5 or BACKEND == "jax" and stopped in (6, 7), output[-3000:]
    newest = kt.checkpoint.latest_checkpoint(str(ckpt))
    step = kt.checkpoint.verify_checkpoint(newest)["global_step"]
    assert newest == str(ckpt / f"ckpt-{step:08d}") and step in (4, 6) and step <= stopped
    assert (f"the newest is {newest} (global step {step}): run the same command again and "
            "AutoResume goes on from it") in output, output[-3000:]
    assert not (ckpt / ".kerastower.lock").exists()  # given back before the exit


def test_a_hung_step_ends_the_process_after_the_grace_period_with_75(tmp_path, script):
    """The step after global step 5 never ends (it waits in C++ code):
    2 s (step_grace_s) after SIGTERM the process ends with status 75 and a
    message; the checkpoint of step 4 is the newest and verifies."""
    ckpt = tmp_path / "ckpt"
    run = _start_hung(script, tmp_path, ckpt, grace=2)
    run.send_signal(signal.SIGTERM)
    status, output, seconds = _ended(run, within=30)
    assert 1.5 < seconds < 10, (seconds, output[-3000:])
    assert "got SIGTERM and the running step has not ended 2 s later (AutoResume's " \
           "step_grace_s=2)" in output, output[-3000:]
    _assert_ended_on_the_last_checkpoint(ckpt, status, output)


def test_a_second_sigterm_during_a_hung_step_ends_the_process_at_once(tmp_path, script):
    ckpt = tmp_path / "ckpt"
    run = _start_hung(script, tmp_path, ckpt, grace=120)
    run.send_signal(signal.SIGTERM)
    time.sleep(1.5)
    run.send_signal(signal.SIGTERM)
    status, output, seconds = _ended(run, within=30)
    assert seconds < 5, (seconds, output[-3000:])
    assert "got SIGTERM, then SIGTERM 1." in output, output[-3000:]
    assert "s later while the step was still running, so training was interrupted" in output
    _assert_ended_on_the_last_checkpoint(ckpt, status, output)


@pytest.fixture(scope="module")
def uninterrupted_stateful(tmp_path_factory, script):
    """The run never interrupted, validated with EarlyStopping, ReduceLROnPlateau, ModelCheckpoint."""
    folder = tmp_path_factory.mktemp("uninterrupted-stateful")
    script.run(folder / "ckpt", folder / "a.npz", "--stateful", "--epochs", "12")
    done = np.load(folder / "a.npz")
    # The premise: EarlyStopping waits after its best epoch, and stops early.
    assert 0 < int(done["best_epoch"]) < int(done["stopped_epoch"]) < 11, dict(done)
    return folder / "a.npz"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_stateful_callbacks_resume_where_they_were_bit_equal(tmp_path, script, uninterrupted_stateful,
                                                            signum):
    """Stopped mid-epoch after the best epoch, while EarlyStopping waits (a
    SIGTERM saves that step; a SIGKILL leaves the last epoch's checkpoint),
    the resumed run stops at the same epoch with the same best weights,
    learning rate and best values as the run never stopped."""
    done = np.load(uninterrupted_stateful)
    steps = int(done["step"])
    ckpt = tmp_path / "ckpt"
    status, output = signal_at_step(script, tmp_path, ckpt, (int(done["best_epoch"]) + 1) * 12 + 5,
                                    "--stateful", "--epochs", "12", signum=signum)
    assert status == (75 if signum == signal.SIGTERM else -signal.SIGKILL), output[-3000:]
    script.run(ckpt, tmp_path / "b.npz", "--stateful", "--epochs", "12")
    assert_bit_equal(uninterrupted_stateful, tmp_path / "b.npz", steps)


class SendSignal(keras.callbacks.Callback):
    """Sends this process `signum` at the end of step `step` of an epoch (1-based)."""

    def __init__(self, step, signum):
        super().__init__()
        self.step, self.signum = step, signum

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self.step:
            signal.raise_signal(self.signum)


def _model():
    inputs = keras.Input((3,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="adam", loss="mse")
    return model


def test_sigusr1_in_process_raises_preempted_at_that_step(two_towers, tmp_path):
    model = _model()
    folder = str(tmp_path / "ckpt")
    with pytest.raises(kt.Preempted) as raised:
        model.fit(np.ones((64, 3)), np.ones((64, 1)), batch_size=4, epochs=2, verbose=0,
                  callbacks=[kt.callbacks.AutoResume(folder), SendSignal(3, signal.SIGUSR1)])
    assert raised.value.code == 75 and raised.value.global_step == 3
    assert raised.value.signal_name == "SIGUSR1"
    assert raised.value.checkpoint == kt.checkpoint.latest_checkpoint(folder)
    state = kt.checkpoint.read_checkpoint(raised.value.checkpoint, model)
    assert (state["global_step"], state["local_step"], state["tower_batches"]) == (3, 3, [3, 3])
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # put back


def test_chosen_signals_and_exit_status_and_off(two_towers, tmp_path):
    model = _model()
    seen = []
    previous = signal.signal(signal.SIGUSR2, lambda *_: seen.append("user handler"))
    try:
        with pytest.raises(kt.Preempted) as raised:
            model.fit(np.ones((64, 3)), np.ones((64, 1)), batch_size=4, verbose=0, callbacks=[
                kt.callbacks.AutoResume(str(tmp_path / "a"), save_on_signals=["SIGUSR2"],
                                        exit_status=99), SendSignal(2, signal.SIGUSR2)])
        assert raised.value.code == 99 and seen == []
        # Off: the signal goes to the handler there was, and training goes on.
        model.fit(np.ones((64, 3)), np.ones((64, 1)), batch_size=4, verbose=0, callbacks=[
            kt.callbacks.AutoResume(str(tmp_path / "b"), save_on_signals=()),
            SendSignal(2, signal.SIGUSR2)])
        assert seen == ["user handler"] and model.loop.local_step == 8
    finally:
        signal.signal(signal.SIGUSR2, previous)
    with pytest.raises(kt.ArgumentError, match="'SIGNOPE'"):
        kt.callbacks.AutoResume(str(tmp_path), save_on_signals=["SIGNOPE"])
    with pytest.raises(kt.ArgumentError, match="SIGKILL cannot be caught"):
        kt.callbacks.AutoResume(str(tmp_path), save_on_signals=["SIGKILL"])


def test_the_watchdog_ends_only_a_step_that_outlives_its_grace_and_never_a_save(capfd):
    from kerastower.loop.preemption import SignalWatch

    def watch(**kwargs):
        ended = []
        return ended, SignalWatch([signal.SIGUSR1], on_end=lambda reason: (75, f"ended: {reason}"),
                                  exit=ended.append, **kwargs)

    # A signal the loop never acted on goes to the handler there was, on exit.
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    try:
        _watchdog_cases(watch, capfd)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    with pytest.raises(kt.ArgumentError, match="step_grace_s=0 is not a number of seconds"):
        kt.callbacks.AutoResume("ckpt", step_grace_s=0)
    assert kt.callbacks.AutoResume("ckpt", step_grace_s=None).step_grace_s is None


def _watchdog_cases(watch, capfd):
    ended, late = watch(grace_s=0.3)
    with late:
        signal.raise_signal(signal.SIGUSR1)
        time.sleep(1.0)
    assert ended == [75] and "got SIGUSR1 and the running step has not ended 0.3 s later" in late.ended
    assert "ended: got SIGUSR1" in capfd.readouterr().err
    ended, saving = watch(grace_s=0.3)
    with saving:
        signal.raise_signal(signal.SIGUSR1)
        saving.begin_save()
        time.sleep(0.6)
        signal.raise_signal(signal.SIGUSR1)  # during the save: counted, ignored
        time.sleep(0.6)
    assert ended == [] and saving.count == 2
    ended, twice = watch(grace_s=None)
    with twice:
        signal.raise_signal(signal.SIGUSR1)
        signal.raise_signal(signal.SIGUSR1)  # the same notice delivered twice
        time.sleep(0.3)
        assert ended == []
        time.sleep(0.9)
        signal.raise_signal(signal.SIGUSR1)
        time.sleep(0.3)
    assert ended == [75] and "then SIGUSR1 1." in twice.ended


def test_a_trainer_is_preempted_too(tmp_path):
    class Count(kt.Trainer):
        def run_step(self):
            if self.global_step == 4:
                signal.raise_signal(signal.SIGTERM)

    with pytest.raises(kt.Preempted) as raised:
        Count().train(steps_per_epoch=3, max_epoch=3, verbose=0,
                      callbacks=[kt.callbacks.AutoResume(str(tmp_path))])
    # The step in which the signal came ends; the trainer stops after it.
    assert raised.value.global_step == 5


def test_a_second_run_on_a_held_folder_refuses_and_the_first_finishes_bit_equal(tmp_path, script,
                                                                                 uninterrupted):
    ckpt = tmp_path / "ckpt"
    first, marks = script.start(tmp_path, ckpt, "first", "--dropout", pause_at=2)
    wait_for(first, marks, "step-2")
    second = script.run(ckpt, tmp_path / "second.npz", "--dropout", ok=False)
    assert "FolderLockedError" in second.stderr, second.stderr[-3000:]
    assert f"in use by another run: process {first.pid} on host" in second.stderr
    assert not (tmp_path / "second.npz").exists()
    go_on(marks)
    assert first.wait(timeout=300) == 0, first.stdout[-3000:]
    assert_bit_equal(uninterrupted, tmp_path / "first.npz", 36)
    assert not (ckpt / ".kerastower.lock").exists()  # released at the end


def test_the_lock_of_a_sigkilled_run_is_taken_over_and_resume_is_bit_equal(tmp_path, script,
                                                                           uninterrupted):
    ckpt = tmp_path / "ckpt"
    killed, marks = script.start(tmp_path, ckpt, "killed", "--dropout", "--save-every", "2",
                                 pause_at=7)
    wait_for(killed, marks, "step-7")
    killed.kill()
    assert killed.wait(timeout=60) == -signal.SIGKILL
    assert (ckpt / ".kerastower.lock").exists()
    resumed = script.run(ckpt, tmp_path / "b.npz", "--dropout")
    assert f"process {killed.pid} on host" in resumed.stderr and "no longer runs" in resumed.stderr
    assert_bit_equal(uninterrupted, tmp_path / "b.npz", 36)


@pytest.fixture(scope="module")
def elastic(tmp_path_factory, script):
    """A deterministic model's uninterrupted run on 2 towers x 4, and a
    checkpoint of the same run preempted after step 5 (40 examples in)."""
    folder = tmp_path_factory.mktemp("elastic")
    script.run(folder / "straight", folder / "a.npz")
    status, output = signal_at_step(script, folder, folder / "ckpt", 5)
    assert status == 75, output[-3000:]
    return folder


def _resume_copy(script, elastic, tmp_path, *flags, ok=True):
    import shutil

    shutil.copytree(elastic / "ckpt", tmp_path / "ckpt")
    return script.run(tmp_path / "ckpt", tmp_path / "b.npz", *flags, ok=ok)


def _assert_close(a_path, b_path, steps):
    a, b = np.load(a_path), np.load(b_path)
    assert int(a["step"]) == int(b["step"]) == steps
    for key in a.files:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-5, err_msg=key)


@pytest.mark.parametrize("towers,batch", [(1, 8), (4, 2)])
def test_two_towers_resume_on_another_number_at_the_same_total_batch(script, elastic, tmp_path, towers,
                                                                    batch):
    done = _resume_copy(script, elastic, tmp_path, "--towers", str(towers), "--batch", str(batch))
    step = kt.checkpoint.verify_checkpoint(kt.checkpoint.latest_checkpoint(str(elastic / "ckpt")))
    assert step["global_step"] == 5
    assert (f"The checkpoint was written by 2 tower(s) x 4 = total batch 8; this run has "
            f"{towers} tower(s) x {batch} = total batch 8: the same total batch. The input goes "
            "on at example 40 of the pass.") in done.stdout, done.stdout[-3000:]
    _assert_close(elastic / "a.npz", tmp_path / "b.npz", 36)


def test_another_total_batch_resumes_saying_so_and_strict_refuses(script, elastic, tmp_path):
    done = _resume_copy(script, elastic, tmp_path, "--towers", "1", "--batch", "12")
    # 40 examples are 3 steps of 12 and 4 examples: those 4 are read again.
    assert ("this run has 1 tower(s) x 12 = total batch 12: another total batch (weights, "
            "optimizer state and step are restored") in done.stdout, done.stdout[-3000:]
    assert "The input goes on at example 36 of the pass (4 example(s) after it" in done.stdout
    assert "going on at epoch 1, step 3." in done.stdout
    b = np.load(tmp_path / "b.npz")
    assert int(b["step"]) == 5 + (8 - 3) + 8 + 8  # the rest of pass 1, then 2 passes of 8 steps
    refused = _resume_copy(script, elastic, tmp_path / "strict", "--towers", "1", "--batch", "12",
                           "--strict", ok=False)
    assert "AutoResume(strict=True) refuses to resume" in refused.stderr
    assert "the total batch differs" in refused.stderr


def test_backup_and_restore_beside_auto_resume_after_a_sigkill_is_bit_equal(tmp_path, script):
    """Keras's BackupAndRestore would load its epoch-end backup over
    AutoResume's step-exact checkpoint (the input going on at the step):
    the step-exact restore wins, BackupAndRestore is told, and the run ends
    bit-equal to an uninterrupted one with the same callbacks."""
    script.run(tmp_path / "straight", tmp_path / "a.npz", "--dropout", "--backup")
    ckpt = tmp_path / "ckpt"
    killed, marks = script.start(tmp_path, ckpt, "killed", "--dropout", "--backup", "--save-every",
                                 "2", pause_at=15)
    wait_for(killed, marks, "step-15")  # epoch 2, step 3: an epoch-end backup and ckpt-14 exist
    killed.kill()
    assert killed.wait(timeout=60) == -signal.SIGKILL
    resumed = script.run(ckpt, tmp_path / "b.npz", "--dropout", "--backup")
    assert "BackupAndRestore does not load its backup over it" in resumed.stdout, resumed.stdout[-3000:]
    assert_bit_equal(tmp_path / "a.npz", tmp_path / "b.npz", 36)
