"""Horovod, for real: `horovodrun -np 2 -H localhost:2 --gloo` on loopback."""

import json
import os
import shutil
import subprocess
import sys
import time


import numpy as np
import pytest

import kerastower as kt

SCRIPT = os.path.join(os.path.dirname(__file__), "horovod_script.py")

# Its module-scoped fixture starts processes once: one pytest-xdist worker runs the module.
pytestmark = [pytest.mark.xdist_group("test_horovod"), pytest.mark.skipif(
    shutil.which("horovodrun") is None,
    reason="Horovod is not installed: run `bash scripts/install-horovod.sh` (the README's test command does)",
)]


def _horovodrun(out, scenario, timeout=300, ranks=2, launcher=False):
    """Runs the script's `scenario` under horovodrun on `ranks` local ranks,
    through `python -m kerastower.launch` when `launcher`."""
    wrap = [sys.executable, "-m", "kerastower.launch"] if launcher else []
    return subprocess.run(
        [*wrap, "horovodrun", "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo",
         sys.executable, SCRIPT, str(out), scenario],
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("horovod")
    result = _horovodrun(out, "train")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    ranks = []
    for rank in (0, 1):
        with open(out / f"results_rank{rank}.json") as f:
            ranks.append(json.load(f))
    return out, ranks


def test_ranks_are_towers_and_end_with_identical_weights(trained):
    out, (r0, r1) = trained
    assert (r0["context"], r1["context"]) == ([0, 2], [1, 2])
    w0, w1 = np.load(out / "weights_rank0.npz"), np.load(out / "weights_rank1.npz")
    for key in w0.files:  # rank 1 started from other weights
        np.testing.assert_array_equal(w0[key], w1[key])
    assert r0["history"] == r1["history"]


def test_a_step_launches_one_collective_and_metrics_are_reduced_per_epoch(trained):
    """Training on an endless input: each step launches one grouped
    allreduce, of the gradients with the example counts folded in; the
    metrics' state is summed once, when the epoch's logs are read.
    Evaluating finite data: whether any rank has data left (a Max of one
    scalar) each step, and the metrics once at the end."""
    _, (r0, r1) = trained
    gradients, metric_state = r0["variables"]
    assert r0["collectives"] == r1["collectives"] == {
        "step": [["all_reduce", gradients + 1]],
        "logs": [["all_reduce", metric_state]],
    }
    # What the traced step holds: that one Horovod op, and no other.
    assert r0["collective_ops"] == {"HorovodGroupedAllreduce": 1}, r0["collective_ops"]
    assert r0["collectives_test"] == r1["collectives_test"] == {
        "step": [["all_reduce", 1]],
        "logs": [["all_reduce", metric_state]],
    }


def test_two_ranks_equal_one_process_on_the_joined_batches(trained):
    """2 ranks x batch 8 for 6 steps = one process x batch 16 for 6 steps;
    the logged metrics and the evaluation are the same too."""
    from tests.tensorflow import horovod_script as script

    out, (r0, _) = trained
    script.assert_equals_one_process(out / "weights_rank0.npz", r0)


def test_seeded_shuffled_arrays_follow_the_chiefs_keras_order_under_horovod(trained):
    """fit(x, y) with Keras's seed set differently on each rank: both read
    the order stock Keras gives one device with the chief's seed."""
    from tests.tensorflow import horovod_script as script

    _, results = trained
    script.assert_seeded_shuffle_equals_one_process(results)


def test_trainers_under_horovod_equal_one_process(trained):
    """kt.GANTrainer and a k-means kt.Trainer on 2 ranks x batch 8 end where
    one process on batch 16 does, on both ranks."""
    from tests.tensorflow import horovod_script as script

    out, _ = trained
    for rank in (0, 1):
        script.assert_trainers_equal_one_process(out / f"trainer_weights_rank{rank}.npz")


def test_only_rank_0_writes_logs_and_checkpoints(trained):
    out, _ = trained
    assert (out / "logs_rank0" / "stats.json").exists() and os.listdir(out / "ckpt_rank0")
    assert not (out / "logs_rank1").exists() and not (out / "ckpt_rank1").exists()


def test_optimizers_built_on_first_use_resume_under_horovod(trained):
    """keras.io's CycleGAN on 2 ranks: the chief's restore builds its four
    optimizers from the checkpoint's slots, the other rank builds the same,
    and the resumed run equals the uninterrupted one on both ranks."""
    _, (r0, r1) = trained
    assert r0["first_use_resume_equal"] and r1["first_use_resume_equal"]


def test_auto_resume_under_horovod(trained):
    _, (r0, r1) = trained
    # Only the chief reads the checkpoint; its variables and resume state
    # reach the other rank by broadcast.
    assert r0["resumed_from"].endswith("ckpt-00000006")
    assert r1["resumed_from"] is None
    for r in (r0, r1):
        assert r["resume_equal"] and r["resumed_step"] == 12


def test_inference_runner_runs_on_every_rank_and_equals_one_process(trained):
    """InferenceRunner is not chief-only: its collective evaluation runs on
    both ranks (the job ends, no rank waits forever), every rank gets the
    same val_* logs, and they equal one process's evaluation."""
    from tests.tensorflow import horovod_script as script

    out, (r0, r1) = trained
    assert sorted(r0["inference"]) == ["val_accuracy", "val_error", "val_loss"]
    assert r0["inference"] == r1["inference"]
    script.assert_inference_equals_one_process(out / "inference_weights_rank0.npz", r0["inference"])


def test_a_rank_that_dies_fails_the_job_fast(tmp_path):
    start = time.time()
    result = _horovodrun(tmp_path, "die", timeout=120)
    assert result.returncode != 0
    assert time.time() - start < 60
    assert "Exit code: 3" in result.stdout + result.stderr


def test_horovod_missing_or_devices_given_is_a_clear_error(monkeypatch):
    with pytest.raises(kt.StrategyError, match="one process per device"):
        kt.distributed("horovod", devices=["/cpu:0"]).strategy
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", None)
    with pytest.raises(kt.StrategyError, match="scripts/install-horovod.sh"):
        kt.distributed("horovod").strategy


def test_a_nan_on_one_rank_stops_every_rank_at_that_step(trained):
    from tests.tensorflow import horovod_script as script

    script.assert_a_nan_stopped_every_process(trained[1])


def test_sigterm_to_one_rank_stops_both_at_one_step_and_resume_is_bit_equal(tmp_path):
    """Rank 1 alone gets SIGTERM after step 5: both ranks stop after it, rank
    0 writes the checkpoint (it verifies), both exit with 75. horovodrun
    alone would exit with 1 (it stops the other ranks when one exits with
    75); `python -m kerastower.launch horovodrun ...` exits with 75. A new
    launch resumes and ends bit-equal to an uninterrupted run."""
    from tests.tensorflow import horovod_script as script

    def launch(phase):
        result = _horovodrun(tmp_path, phase, launcher=True)
        output = result.stdout[-4000:] + result.stderr[-2000:]
        if phase == "resume":
            assert result.returncode == 0, output
            return
        assert result.returncode == 75, output
        assert "Exiting with status 75: run the same command again" in result.stdout, output
        assert "process(es) of the run ended on a preemption" in result.stderr, output
        assert "horovodrun ended with status 1. Exiting with status 75" in result.stderr, output
        saved = kt.checkpoint.latest_checkpoint(str(tmp_path / "ckpt_preempted"))
        assert kt.checkpoint.verify_checkpoint(saved)["global_step"] == int(saved[-8:])

    script.assert_preempted_then_resumed_bit_equal(tmp_path, launch)
