"""The one set-up of every test: the backend's devices, the seed, which folders run.

`python -m pytest` runs tests/tensorflow/ and tests/shared/ on TensorFlow;
`KERAS_BACKEND=jax python -m pytest` (scripts/test-jax.sh) runs tests/jax/
and tests/shared/ on JAX. Keras picks its backend once per process, so the
other backend's folder is left out. tests/helpers/ holds what the folders
share; every process a test starts can import it (and examples/), from
PYTHONPATH.
"""

import os

from tests.helpers.common import BACKEND  # first: it makes the devices before the backend starts
from tests.helpers.common import ROOT
from tests.helpers.common import tower_devices

import keras  # noqa: E402 (after the devices)
import pytest  # noqa: E402

import kerastower as kt  # noqa: E402

os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))

_OTHER_BACKEND = {"tensorflow": "jax", "jax": "tensorflow"}[BACKEND]


def pytest_ignore_collect(collection_path, config):
    if collection_path.name == _OTHER_BACKEND and str(collection_path.parent) == os.path.join(ROOT, "tests"):
        return True
    return None


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(1234)
    yield


@pytest.fixture
def two_towers():
    """2 towers on this backend."""
    with kt.distributed("mirrored", devices=tower_devices(2)) as strategy:
        yield strategy
