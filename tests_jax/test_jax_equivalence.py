"""N towers on JAX train exactly like one device on the joined batch.

The equivalence matrix of tests/test_equivalence_matrix.py, on JAX: the
same cases (tests/equivalence_cases.py: what Keras users write, keras.io's
custom step in its JAX form), each built twice with the same initial
weights, trained on one device with batch N x b and on N towers with batch
b over the same arrays (tower k takes the k-th next batch), comparing the
weights and every logged value. Every step is whole (b = B on 2 towers, 6
on 4): a model's own tracker that counts one update per tower (a
`compute_loss` override's Mean) would count a joined short last step once
(docs/jax.md); test_jax_towers.py checks that step's update.
"""

import keras
import numpy as np
import pytest

import kerastower as kt
from equivalence_cases import B
from equivalence_cases import CASES
from equivalence_cases import N
from equivalence_cases import OPTIMIZERS
from equivalence_cases import TOLERANCE
from equivalence_cases import fit_case
from equivalence_cases import initial_weights


# masked_sequence's data gives 8-row batches equal real-token counts, the
# condition for a masked loss to be exact (docs/training.md); the 6-row
# batches of 4 towers do not have it.
MATRIX = [(case, optimizer, towers) for towers in (2, 4) for case in sorted(CASES)
          for optimizer in sorted(OPTIMIZERS) if not (towers == 4 and case == "masked_sequence")]


@pytest.mark.parametrize("case,optimizer_name,towers", MATRIX)
def test_towers_equal_one_device(case, optimizer_name, towers):
    per_tower = B if towers == 2 else N // (towers * 2)   # whole steps: 3 of 2 x 8, 2 of 4 x 6
    initial = initial_weights(case)
    with kt.distributed("single"):
        one, one_logs = fit_case(case, optimizer_name, towers * per_tower, initial)
    with kt.distributed("mirrored", devices=list(range(towers))):
        many, many_logs = fit_case(case, optimizer_name, per_tower, initial)
    moved = max(float(np.abs(a - w).max()) for a, w in zip(one.get_weights(), initial))
    assert moved > 1e-3, "training must move the weights for the comparison to mean anything"
    assert int(one.optimizer.iterations.numpy()) == int(many.optimizer.iterations.numpy()) > 0
    atol = TOLERANCE.get(case, 1e-5)
    for a, b, w in zip(one.get_weights(), many.get_weights(), one.weights):
        np.testing.assert_allclose(b, a, atol=atol, err_msg=f"{case}/{optimizer_name}: {w.path}")
    assert sorted(one_logs) == sorted(many_logs)
    for key in one_logs:
        np.testing.assert_allclose(many_logs[key], one_logs[key], atol=atol,
                                   err_msg=f"{case}/{optimizer_name}: logged {key}")
