"""kt.distributed("multihost"): 2 real processes joined by jax.distributed (2 CPU
devices each, gloo collectives on loopback) equal one device on the joined batch."""

import os
import shutil
import subprocess
import sys

import jax
import keras
import numpy as np
import pytest

import kerastower as kt

HERE = os.path.dirname(__file__)

from tests.helpers.common import free_port
from tests.jax import multihost_script

# Its module-scoped fixture starts processes once: one pytest-xdist worker runs the module.
pytestmark = pytest.mark.xdist_group("test_jax_multihost")


def _run_two_processes(tmp_path, *flags, timeout=300, status=0):
    port = free_port()
    ckpt_dir = tmp_path / "ckpt"
    procs, outs = [], []
    for process in range(2):
        env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu",
                   XLA_FLAGS="--xla_force_host_platform_device_count=2",
                   JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                   JAX_PROCESS_ID=str(process))
        outs.append(tmp_path / f"process{process}{''.join(flags)}.npz")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, "multihost_script.py"), str(outs[-1]), str(ckpt_dir),
             *flags],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            proc.kill()
    for process, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == status, f"process {process} ended with {proc.returncode}:\n{log[-6000:]}"
    return [dict(np.load(out)) for out in outs], ckpt_dir


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    return _run_two_processes(tmp_path_factory.mktemp("multihost"))


def _reference(epochs=2):
    """The chief's run on one device, with the batch of all 4 towers."""
    with kt.distributed("single"):
        keras.utils.set_random_seed(1234)
        model = multihost_script.batchnorm_model()
    x, y, weight = multihost_script.data()
    np.random.seed(0)
    history = model.fit(x, y, sample_weight=weight, batch_size=4 * multihost_script.BATCH,
                        epochs=epochs, shuffle=True, verbose=0)
    evaluated = model.evaluate(x[:50], y[:50], batch_size=4 * multihost_script.BATCH,
                               verbose=0, return_dict=True)
    predicted = model.predict(x[:50], batch_size=4 * multihost_script.BATCH, verbose=0)
    return multihost_script.results(model, history.history, evaluated, predicted)


def test_two_processes_equal_one_device_on_the_joined_batch(two_processes):
    found, _ = two_processes
    expected = _reference()
    assert int(expected["global_step"]) == 8  # 4 steps a pass, the last one short
    _assert_equal_to(expected, found)


def _assert_equal_to(expected, found, skip=()):
    for process, result in enumerate(found):
        assert set(result) - {"is_chief"} == set(expected)
        for key, value in expected.items():
            if key not in skip:
                np.testing.assert_allclose(result[key], value, rtol=1e-5, atol=1e-5,
                                           err_msg=f"process {process}: {key}")


def test_only_the_chief_writes_and_both_agree(two_processes):
    found, ckpt_dir = two_processes
    assert [bool(r["is_chief"]) for r in found] == [True, False]
    assert sorted(os.listdir(ckpt_dir)) == ["ckpt-00000004", "ckpt-00000008"]
    for key in found[0]:
        if key.startswith("w"):
            np.testing.assert_array_equal(found[0][key], found[1][key])


def test_auto_resume_goes_on_from_the_chiefs_checkpoint(two_processes, tmp_path):
    _, ckpt_dir = two_processes
    shutil.copytree(ckpt_dir, tmp_path / "ckpt")
    found, _ = _run_two_processes(tmp_path, "--resume")
    # Epoch 3 only: History holds it alone, from the restored step 8 to 12.
    expected = _reference(epochs=3)
    assert [int(r["global_step"]) for r in found] == [12, 12]
    _assert_equal_to(expected, found, skip=[k for k in expected if k.startswith("history_")])
    for result in found:
        np.testing.assert_allclose(result["history_loss"], expected["history_loss"][-1:], rtol=1e-5)


def test_sigterm_to_one_process_stops_both_at_one_step_and_resume_equals_one_device(tmp_path):
    """Process 1 alone gets SIGTERM after step 5: both stop at the next step
    they agree on (by the epoch's end), the chief
    writes the checkpoint, both exit with 75; a new launch resumes and ends
    at the weights of one device trained straight through."""
    stops, ckpt_dir = _run_two_processes(tmp_path, "--preempt", status=75)
    assert [int(s["code"]) for s in stops] == [75, 75]
    # They agree every few steps and at each epoch's end (step 8).
    step = int(stops[0]["step"])
    assert int(stops[1]["step"]) == step and 5 <= step <= 8, stops
    assert [str(s["signal"]) for s in stops] == ["None", "SIGTERM"]
    assert str(stops[0]["checkpoint"]) == str(stops[1]["checkpoint"]) == str(ckpt_dir / f"ckpt-{step:08d}")
    found, _ = _run_two_processes(tmp_path, "--resume")
    expected = _reference(epochs=3)
    assert [int(r["global_step"]) for r in found] == [12, 12]
    _assert_equal_to(expected, found, skip=[k for k in expected if k.startswith("history_")])


def test_multihost_refuses_devices_and_names_the_variables_it_needs(monkeypatch):
    with pytest.raises(kt.StrategyError, match="every device of every"):
        kt.distributed("multihost", devices=jax.devices()[:2]).strategy
    # This process already runs JAX: jax.distributed can no longer start.
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    with pytest.raises(kt.StrategyError, match="JAX_COORDINATOR_ADDRESS"):
        kt.distributed("multihost").strategy
