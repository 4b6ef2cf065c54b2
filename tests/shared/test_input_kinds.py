"""One input chooser for both backends, and a new kind of input in one place (issue 56).

`kt.register_input_kind` teaches fit a kind of input it does not know,
once, for both backends: here a columnar table (read as arrays) and a
stream of records (read as a Python source of batches). Each trains on a
strategy registered in one place too (test_strategy_registry.py's
subclass of the backend's own), against one device on the joined batch.
"""

import keras
import numpy as np
import pytest

import kerastower as kt
from kerastower.inputs import chooser
from kerastower.strategies import switch

from tests.helpers.common import BACKEND
from tests.shared.test_strategy_registry import _first_two

FEATURES = ("a", "b", "c")


class Table:
    """Columns by name, the target among them: what a dataframe library holds."""

    def __init__(self, columns):
        self.columns = columns


def table_as_arrays(x, y, sample_weight):
    features = np.stack([x.columns[name] for name in FEATURES], axis=1)
    return features.astype("float32"), x.columns["target"][:, None].astype("float32"), sample_weight


class Records:
    """One (features, target) record at a time, grouped into batches of `per_batch`."""

    def __init__(self, features, target, per_batch):
        self.features, self.target, self.per_batch = features, target, per_batch


class RecordBatches:
    """Records read as batches, afresh each pass (an iterable, not an iterator)."""

    def __init__(self, records):
        self.records = records

    def __iter__(self):
        r = self.records
        for start in range(0, len(r.target), r.per_batch):
            end = start + r.per_batch
            yield r.features[start:end], r.target[start:end]


@pytest.fixture
def registered():
    kt.register_input_kind("table", lambda x: isinstance(x, Table), table_as_arrays)
    kt.register_input_kind(
        "records", lambda x: isinstance(x, Records), lambda x, y, w: (RecordBatches(x), y, w))
    kt.register_strategy("first_two", _first_two)
    yield
    chooser.forget_input_kind("table")
    chooser.forget_input_kind("records")
    switch._REGISTRY[BACKEND].pop("first_two")


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype("float32")
    return x, x.sum(axis=1, keepdims=True).astype("float32")


def _fit(data, epochs, strategy=None, **fit_kwargs):
    keras.utils.set_random_seed(1)

    def build():
        inputs = keras.Input((3,))
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(keras.layers.Dense(4, "tanh")(inputs)))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        history = model.fit(*data, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
        return model, history.history["loss"]

    if strategy is None:
        return build()
    with kt.distributed(strategy):
        return build()


def _assert_same(towers, one):
    (model, losses), (one_model, one_losses) = towers, one
    assert model.num_towers == 2
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    for a, b in zip(model.get_weights(), one_model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_a_registered_kind_read_as_arrays_trains_as_one_device(registered):
    x, y = _data()
    table = Table({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "target": y[:, 0]})
    choice = chooser.choose(table, batch_size=4)
    assert (choice.kind, choice.registered) == ("arrays", "table")
    towers = _fit((table,), 2, "first_two", batch_size=4)
    _assert_same(towers, _fit((x, y), 2, batch_size=8))


def test_a_registered_kind_read_as_batches_trains_as_one_device(registered):
    x, y = _data()
    assert chooser.choose(Records(x, y, 4)).kind == "batches"
    towers = _fit((Records(x, y, 4),), 2, "first_two")
    # One device on the joined batches: the batches 2s and 2s+1 the towers took.
    _assert_same(towers, _fit((RecordBatches(Records(x, y, 8)),), 2))


def test_the_chooser_says_what_it_takes_and_refuses_bad_kinds():
    with pytest.raises(kt.InputSourceError, match="register_input_kind; got x of type object"):
        chooser.choose(object())
    with pytest.raises(kt.InputSourceError, match="not one of the built-in kinds"):
        kt.register_input_kind("arrays", bool, bool)
    with pytest.raises(kt.InputSourceError, match=r"register_input_kind\('odd'\): convert must be callable"):
        kt.register_input_kind("odd", bool, "not a function")
    with pytest.raises(kt.InputSourceError, match="batch_size=4 was given with a generator"):
        chooser.choose((b for b in []), batch_size=4)
    kt.register_input_kind("half_done", lambda x: isinstance(x, Table), lambda x, y, w: (x, y, w))
    try:
        with pytest.raises(kt.InputSourceError, match="'half_done' converted its input into a Table"):
            chooser.choose(Table({}))
    finally:
        chooser.forget_input_kind("half_done")
    assert chooser.kind_of(np.ones((2, 2))) == "arrays"
    assert chooser.kind_of({"a": np.ones(2), "b": [np.ones(2)]}) == "arrays"
    assert chooser.kind_of(iter([])) == "batches"
    assert chooser.kind_of(keras.utils.PyDataset()) == "batches"
