"""A pytest plugin that runs Keras's own tests with TowerModels in place of Keras's models.

Loaded with `-p keras_suite_plugin` on Keras's installed test files
(keras/src/callbacks/*_test.py, keras/src/trainers/trainer_test.py); read
tests/shared/test_keras_own_tests.py, which runs it. Set by the environment:

- `KT_SUITE_MODE`: "stock" runs Keras's tests as they are (the baseline);
  "towers" gives each test module, for the test's duration, names under
  which Keras's models are TowerModels: `models.Sequential`,
  `Sequential`, `keras.Sequential` make a `kt.TowerSequential`;
  `models.Model`, `Model`, `keras.Model`, `Functional` a `kt.TowerModel`
  (functional when given inputs and outputs, the base of a subclass
  defined in the test).
- `KT_SUITE_TOWERS`: in "towers" mode, 2 runs each test inside
  `kt.distributed("mirrored")` on 2 CPU devices; else one tower, outside
  every block, as a user switching a script over writes it.
- `KT_SUITE_REPORT`: a JSON file written at the end: for each test its
  outcome and how many models it built (Keras models in "stock" mode,
  TowerModels in "towers" mode), so that a test built on Keras's own
  model alone cannot pass unnoticed.
"""

import json
import os
import types

import pytest

from kerastower._compat import functional_class

MODE = os.environ.get("KT_SUITE_MODE", "towers")
TOWERS = int(os.environ.get("KT_SUITE_TOWERS", "1"))

_results = {}
_built = {"count": 0}


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_trainable_backend: Keras's own marker")
    import kerastower as kt

    kt.use_cpu_towers(2)  # before the backend starts: both modes see the same devices


def _counting(cls):
    original = cls.__init__

    def counted_init(self, *args, **kwargs):
        _built["count"] += 1
        return original(self, *args, **kwargs)

    cls.__init__ = counted_init


def pytest_sessionstart(session):
    import keras

    import kerastower as kt

    _counting(kt.TowerModel if MODE == "towers" else keras.Model)


class _Proxy(types.ModuleType):
    """A module that is `module`, but for the names given in `replaced`."""

    def __init__(self, module, replaced):
        super().__init__(module.__name__)
        self.__dict__.update(replaced)
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


def _tower_names(namespace):
    import keras

    import kerastower as kt

    models = {"Sequential": kt.TowerSequential, "Model": kt.TowerModel, "Functional": kt.TowerModel}
    replaced = {}
    for name, value in list(namespace.items()):
        if name in models and value in (keras.Sequential, keras.Model, functional_class()):
            replaced[name] = models[name]
        elif isinstance(value, types.ModuleType) and value.__name__ in ("keras", "keras.src.models"):
            replaced[name] = _Proxy(value, dict(models))
    return replaced


@pytest.fixture(autouse=True)
def _kerastower_models(request, monkeypatch):
    if MODE != "towers":
        yield
        return
    namespace = request.module.__dict__
    for name, value in _tower_names(namespace).items():
        monkeypatch.setitem(namespace, name, value)
    if TOWERS > 1:
        import kerastower as kt

        with kt.distributed("mirrored", devices=kt.use_cpu_towers(TOWERS)):
            yield
    else:
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _built["count"] = 0
    yield
    _results.setdefault(item.nodeid, {})["built"] = _built["count"]


def pytest_runtest_logreport(report):
    entry = _results.setdefault(report.nodeid, {})
    if report.when == "call" or report.outcome != "passed":
        if entry.get("outcome") in (None, "passed"):
            entry["outcome"] = report.outcome


def pytest_sessionfinish(session):
    path = os.environ.get("KT_SUITE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_results, f, indent=1, sort_keys=True)
