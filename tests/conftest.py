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


# KT_TEST_TIMELINE=<file>: each test's start, end, CPU time and time in
# Python's garbage collector, one JSON line per test, for finding what
# makes a test slow inside the suite when it is fast alone.
_TIMELINE = os.environ.get("KT_TEST_TIMELINE")
if _TIMELINE:
    import gc
    import json
    import time

    _gc_seconds = [0.0, None]

    def _gc_timer(phase, info):
        if phase == "start":
            _gc_seconds[1] = time.perf_counter()
        elif _gc_seconds[1] is not None:
            _gc_seconds[0] += time.perf_counter() - _gc_seconds[1]

    gc.callbacks.append(_gc_timer)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        start, cpu, in_gc = time.time(), time.process_time(), _gc_seconds[0]
        yield
        record = {"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                  "start": start, "seconds": time.time() - start,
                  "cpu": time.process_time() - cpu, "gc": _gc_seconds[0] - in_gc}
        with open(_TIMELINE, "a") as f:
            f.write(json.dumps(record) + "\n")
