"""MultiWorkerMirroredStrategy: 2 real worker processes on loopback (forked by the zygote)."""

import json
import os

import numpy as np
import pytest

import kerastower as kt
from tests.tensorflow.helpers import launch_workers
from tests.tensorflow.helpers import worker_outputs

# Its module-scoped fixture starts processes once: one pytest-xdist worker runs the module.
pytestmark = pytest.mark.xdist_group("test_multiworker")

SCRIPT = os.path.join(os.path.dirname(__file__), "multiworker_script.py")


@pytest.fixture(scope="module")
def workers(tmp_path_factory, zygote):
    out = tmp_path_factory.mktemp("multiworker")
    runs = launch_workers(zygote, SCRIPT, out)
    outputs = worker_outputs(runs)
    for run, output in zip(runs, outputs):
        assert run.returncode == 0, output[-4000:]
    results = []
    for index in range(2):
        with open(out / f"results_worker{index}.json") as f:
            results.append(json.load(f))
    return out, results


def test_workers_end_identical_and_equal_one_process_on_the_joined_batches(workers):
    from tests.tensorflow import horovod_script as shared

    out, (w0, w1) = workers
    assert w0["towers"] == w1["towers"] == 2
    weights = [np.load(out / f"weights_worker{i}.npz") for i in range(2)]
    for key in weights[0].files:  # worker 1 started from other weights
        np.testing.assert_array_equal(weights[0][key], weights[1][key])
    for key in ("loss", "accuracy"):  # the chief also logs throughput
        assert w0["history"][key] == w1["history"][key]

    shared.assert_equals_one_process(out / "weights_worker0.npz", w0)


def test_a_step_launches_one_collective_and_metrics_are_reduced_per_epoch(workers):
    """As under Horovod, on an endless input: one batched all-reduce of the
    gradients and example counts per step (TensorFlow packs it into one
    op); the metrics' state is summed in one all-reduce when the logs are
    read."""
    _, (w0, w1) = workers
    gradients, metric_state = w0["variables"]
    assert w0["collectives"] == w1["collectives"] == {
        "step": [["all_reduce", gradients + 1]],
        "logs": [["all_reduce", metric_state]],
    }
    assert w0["collective_ops"] == {"CollectiveReduceV2": 1}, w0["collective_ops"]


def test_optimizers_built_on_first_use_resume_on_every_worker(workers):
    """keras.io's CycleGAN on 2 workers: its optimizers build on first use;
    a resume builds them on every worker (building is collective there)
    before the chief restores, and equals the uninterrupted run."""
    _, results = workers
    assert all(r["first_use_resume_equal"] for r in results), results


def test_seeded_shuffled_arrays_follow_the_chiefs_keras_order(workers):
    """fit(x, y) with Keras's seed set differently on each worker: both read
    the order stock Keras gives one device with the chief's seed, and equal
    that device on the joined batch."""
    from tests.tensorflow import horovod_script as shared

    _, results = workers
    shared.assert_seeded_shuffle_equals_one_process(results)


def test_only_the_chief_writes_logs(workers):
    out, _ = workers
    assert (out / "logs_worker0" / "stats.json").exists()
    assert not (out / "logs_worker1").exists()


def test_multiworker_without_tf_config_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(kt.StrategyError, match="needs the TF_CONFIG environment variable"):
        kt.distributed("multiworker").strategy


def test_a_worker_that_dies_makes_the_other_fail_fast_and_clearly(tmp_path, zygote):
    import time

    start = time.time()
    chief, dying = launch_workers(zygote, SCRIPT, tmp_path, "die")
    chief.wait(timeout=120)
    output = chief.stdout
    dying.wait(timeout=30)
    assert dying.returncode == 3
    assert chief.returncode != 0 and time.time() - start < 60
    assert "PeerFailureError: Another worker of this training stopped responding" in output


@pytest.mark.parametrize("workers,local_towers", [(2, 1), (2, 2), (3, 2), (2, 4)])
def test_towers_in_index_order_hold_a_steps_batches_in_input_order(workers, local_towers):
    """What predict relies on with several devices per worker (which
    MultiWorkerMirroredStrategy gives GPU workers only): tower w * L + i of
    step s takes the (s * W * L + w * L + i)-th batch."""
    import tensorflow as tf

    from kerastower.strategies.multiworker import worker_shard

    towers = workers * local_towers
    steps = 3
    batches = tf.data.Dataset.range(steps * towers)
    shards = [list(worker_shard(batches, workers, w, local_towers).as_numpy_iterator())
              for w in range(workers)]
    in_tower_order = [
        shards[w][s * local_towers + i]  # a worker's towers take successive batches
        for s in range(steps) for w in range(workers) for i in range(local_towers)
    ]
    assert in_tower_order == list(range(steps * towers))


def test_a_nan_on_one_worker_stops_every_worker_at_that_step(workers):
    from tests.tensorflow import horovod_script as shared

    shared.assert_a_nan_stopped_every_process(workers[1])


def test_sigterm_to_one_worker_stops_both_at_one_step_and_resume_is_bit_equal(tmp_path, zygote):
    from tests.tensorflow import horovod_script as script

    def launch(phase):
        runs = launch_workers(zygote, SCRIPT, tmp_path, phase)
        outputs = worker_outputs(runs)
        expected = [0, 0] if phase == "resume" else [75, 75]
        assert [run.returncode for run in runs] == expected, "\n".join(o[-3000:] for o in outputs)

    script.assert_preempted_then_resumed_bit_equal(tmp_path, launch)
