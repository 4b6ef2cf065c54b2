"""N towers on JAX train exactly like one device on the joined batch.

The equivalence matrix of tests/tensorflow/test_equivalence_matrix.py, on JAX: the
same cases (tests/helpers/equivalence_cases.py: what Keras users write, keras.io's
custom step in its JAX form), each built twice with the same initial
weights, trained on one device with batch N x b and on N towers with batch
b over the same arrays (tower k takes the k-th next batch), comparing the
weights and every logged value. Every step is whole (b = B on 2 towers, 6
on 4): a model's own tracker that counts one update per tower (a
`compute_loss` override's Mean) would count a joined short last step once
(docs/jax.md); test_jax_towers.py checks that step's update.
"""

import pytest

from tests.helpers.equivalence_cases import B
from tests.helpers.equivalence_cases import CASES
from tests.helpers.equivalence_cases import N
from tests.helpers.equivalence_cases import OPTIMIZERS
from tests.helpers.equivalence_cases import check_towers_equal_one_device


# On 4 towers every case runs with Adam only: what 4 towers change from 2
# (the divisor of the gradients' mean, which batch each tower takes) is
# before the optimizer, which gets the same mean either way, and Adam's
# update is the one most sensitive to a wrong gradient; the other
# optimizers run every case on 2 towers. masked_sequence's data gives
# 8-row batches equal real-token counts, the condition for a masked loss to
# be exact (docs/training.md); the 6-row batches of 4 towers do not have it.
MATRIX = ([(case, optimizer, 2) for case in sorted(CASES) for optimizer in sorted(OPTIMIZERS)]
          + [(case, "adam", 4) for case in sorted(CASES) if case != "masked_sequence"])


@pytest.mark.parametrize("case,optimizer_name,towers", MATRIX)
def test_towers_equal_one_device(case, optimizer_name, towers):
    per_tower = B if towers == 2 else N // (towers * 2)   # whole steps: 3 of 2 x 8, 2 of 4 x 6
    check_towers_equal_one_device(case, optimizer_name, list(range(towers)), per_tower)
