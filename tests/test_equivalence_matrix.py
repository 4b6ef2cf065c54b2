"""The promise, as a differential matrix: 2 towers x B examples train exactly
like one device on the joined 2B batch, for the models Keras users write.

Each case (tests/equivalence_cases.py) builds the same model twice (same
initial weights), trains it on one device with batch 2B and on 2 mirrored
towers with batch B over the same arrays (tower k takes the k-th next batch,
so a step's towers hold the same 2B examples as the one-device batch), and
compares the weights and every logged value.
"""

import numpy as np
import pytest

import kerastower as kt
from conftest import TWO
from equivalence_cases import B
from equivalence_cases import CASES
from equivalence_cases import OPTIMIZERS
from equivalence_cases import STEPS
from equivalence_cases import TOLERANCE
from equivalence_cases import fit_case
from equivalence_cases import initial_weights


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_two_towers_equal_one_device(case, optimizer_name):
    initial = initial_weights(case)
    with kt.distributed("single"):
        one, one_logs = fit_case(case, optimizer_name, 2 * B, initial)
    with kt.distributed("mirrored", devices=TWO):
        two, two_logs = fit_case(case, optimizer_name, B, initial)
    moved = max(float(np.abs(a - w).max()) for a, w in zip(one.get_weights(), initial))
    assert moved > 1e-3, "training must move the weights for the comparison to mean anything"
    assert one.optimizer.iterations.numpy() == two.optimizer.iterations.numpy() == 2 * STEPS
    atol = TOLERANCE.get(case, 1e-5)
    for a, b, w in zip(one.get_weights(), two.get_weights(), one.weights):
        np.testing.assert_allclose(b, a, atol=atol, err_msg=f"{case}/{optimizer_name}: {w.path}")
    assert sorted(one_logs) == sorted(two_logs)
    for key in one_logs:
        np.testing.assert_allclose(two_logs[key], one_logs[key], atol=atol,
                                   err_msg=f"{case}/{optimizer_name}: logged {key}")
