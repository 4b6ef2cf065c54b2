"""The one set-up of every test: the backend's devices, the seed, which folders run.

`python -m pytest` runs tests/tensorflow/ and tests/shared/ on TensorFlow;
`KERAS_BACKEND=jax python -m pytest` (scripts/test-jax.sh) runs tests/jax/
and tests/shared/ on JAX. Keras picks its backend once per process, so the
other backend's folder is left out. tests/helpers/ holds what the folders
share; every process a test starts can import it (and examples/), from
PYTHONPATH.
"""

import gc
import os
import time

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


# A tf.data iterator that reached its end waits, when it is freed, for its
# autotuning thread's next wake-up (TensorFlow 2.21: the longer the
# iterator lived, the later, up to about a minute), holding Python's GIL.
# Iterators kept in reference cycles (a model and its traced functions)
# were freed by some later test's collection, minutes old: 23 tests waited
# 930 s in all, once 465 s in one collection (docs/performance.md). A
# collection after every test that ran something frees them young; what
# it leaves alive is then frozen (`gc.freeze`), so that the next
# collection reads only what later tests made (a full collection of the
# whole heap took about a second).
_COLLECT_AFTER_SECONDS = 0.5


@pytest.fixture(autouse=True)
def _free_iterators_young():
    start = time.monotonic()
    yield
    if time.monotonic() - start >= _COLLECT_AFTER_SECONDS:
        gc.collect()
        gc.freeze()


@pytest.fixture(scope="session")
def zygote(tmp_path_factory):
    """A process that imported this backend once and forks each run of a
    test's script (tests/helpers/zygote.py): one per pytest-xdist worker,
    started when a test first asks for it."""
    from tests.helpers.zygote import Zygote

    started = Zygote(tmp_path_factory.mktemp("zygote"), env=dict(os.environ, KERAS_BACKEND=BACKEND))
    yield started
    started.close()


@pytest.fixture
def two_towers():
    """2 towers on this backend."""
    with kt.distributed("mirrored", devices=tower_devices(2)) as strategy:
        yield strategy


# KT_TEST_TIMELINE=<file>: each test's start, wall and CPU seconds, its
# seconds in Python's garbage collector (full collections apart) and the
# memory blocks alive after it, one JSON line per test: for finding what
# makes a test slow inside the suite when it is fast alone.
_TIMELINE = os.environ.get("KT_TEST_TIMELINE")
if _TIMELINE:
    import json
    import sys

    _in_gc = {"seconds": 0.0, "full": 0.0, "started": None}

    def _gc_timer(phase, info):
        if phase == "start":
            _in_gc["started"] = time.perf_counter()
        elif _in_gc["started"] is not None:
            took = time.perf_counter() - _in_gc["started"]
            _in_gc["seconds"] += took
            if info["generation"] == 2:
                _in_gc["full"] += took

    gc.callbacks.append(_gc_timer)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        start, cpu, before = time.time(), time.process_time(), dict(_in_gc)
        yield
        record = {"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                  "start": round(start, 2), "seconds": round(time.time() - start, 2),
                  "cpu": round(time.process_time() - cpu, 2),
                  "gc": round(_in_gc["seconds"] - before["seconds"], 2),
                  "full_gc": round(_in_gc["full"] - before["full"], 2),
                  "blocks": sys.getallocatedblocks()}
        with open(_TIMELINE, "a") as f:
            f.write(json.dumps(record) + "\n")
