"""The promise, as a differential matrix: 2 towers x B examples train exactly
like one device on the joined 2B batch, for the models Keras users write.

Each case (tests/helpers/equivalence_cases.py) builds the same model twice (same
initial weights), trains it on one device with batch 2B and on 2 mirrored
towers with batch B over the same arrays (tower k takes the k-th next batch,
so a step's towers hold the same 2B examples as the one-device batch), and
compares the weights and every logged value.
"""

import pytest

from tests.tensorflow.helpers import TWO
from tests.helpers.equivalence_cases import CASES
from tests.helpers.equivalence_cases import OPTIMIZERS
from tests.helpers.equivalence_cases import check_towers_equal_one_device


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_two_towers_equal_one_device(case, optimizer_name):
    check_towers_equal_one_device(case, optimizer_name, TWO)
