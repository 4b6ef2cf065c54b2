"""The equivalence matrix's subset on 2 Horovod ranks and 2 multi-worker
workers (real processes on loopback): each equals one device on the joined
batches, validation included, and both processes end identical."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import kerastower as kt
from tests.helpers.equivalence_cases import B
from tests.helpers.equivalence_cases import DISTRIBUTED_SUBSET as SUBSET
from tests.helpers.equivalence_cases import fit_case
from tests.helpers.equivalence_cases import initial_weights
from tests.helpers.equivalence_cases import one_device_reference
from tests.tensorflow.helpers import launch_workers
from tests.tensorflow.helpers import worker_outputs

# Its module-scoped fixture starts processes once: one pytest-xdist worker runs the module.
pytestmark = pytest.mark.xdist_group("test_equivalence_distributed")

SCRIPT = os.path.join(os.path.dirname(__file__), "distributed_equivalence_script.py")


def _horovod(out, zygote):
    """horovodrun's 2 ranks: (exit status, output) of the launcher."""
    launcher = subprocess.run(
        ["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, SCRIPT,
         str(out), "horovod"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=400)
    return [(launcher.returncode, launcher.stdout)]


def _multiworker(out, zygote):
    """2 workers the zygote forks: (exit status, output) of each."""
    runs = launch_workers(zygote, SCRIPT, out, "multiworker")
    return list(zip((run.wait(timeout=400) for run in runs), worker_outputs(runs, timeout=400)))


LAUNCHERS = {"horovod": _horovod, "multiworker": _multiworker}


@pytest.fixture(scope="module", params=sorted(LAUNCHERS))
def run(request, tmp_path_factory, zygote):
    name = request.param
    if name == "horovod" and shutil.which("horovodrun") is None:
        pytest.skip("Horovod is not installed: run `bash scripts/install-horovod.sh`")
    out = tmp_path_factory.mktemp(name)
    initial = {}
    for case, _ in SUBSET:
        initial[case] = initial_weights(case)
        np.savez(out / f"initial_{case}.npz", *initial[case])
    for status, output in LAUNCHERS[name](out, zygote):
        assert status == 0, output[-4000:]
    results = []
    for index in range(2):
        with open(out / f"results_{index}.json") as f:
            results.append(json.load(f))
    return name, out, initial, results


@pytest.mark.parametrize("case,optimizer_name", SUBSET)
def test_two_processes_equal_one_device_on_the_joined_batches(run, case, optimizer_name):
    name, out, initial, results = run
    assert results[0]["towers"] == results[1]["towers"] == 2
    finals = [list(np.load(out / f"final_{case}_{optimizer_name}_{i}.npz").values()) for i in range(2)]
    for a, b in zip(*finals):  # process 1 started from other weights: the chief's won
        np.testing.assert_array_equal(a, b)
    reference, steps = one_device_reference(optimizer_name)
    with kt.distributed("single"):
        one, one_logs = fit_case(case, reference, 2 * B * steps, initial[case])
    for a, b in zip(one.get_weights(), finals[0]):
        np.testing.assert_allclose(b, a, atol=1e-5, err_msg=f"{name} {case}")
    logs = results[0][f"{case}/{optimizer_name}"]
    assert sorted(logs) == sorted(one_logs)
    for key in one_logs:
        np.testing.assert_allclose(logs[key], one_logs[key], atol=1e-5,
                                   err_msg=f"{name} {case}: logged {key}")


def test_shuffled_arrays_are_partitioned_across_processes_whatever_their_seeds(run):
    _, _, _, results = run
    assert sorted(results[0]["seen_ids"] + results[1]["seen_ids"]) == list(range(64))
