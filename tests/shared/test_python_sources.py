"""Python generators, iterables and keras.utils.PyDataset as input, on both backends.

tensorpack's tower semantics: nothing is split, and tower k of step s takes
the source's batch s * N + k. The differential cases train the same model
on N towers from a source, and on one device from numpy arrays cut into
N x B examples a step: the N batches of each step joined. Weights and every
logged value must agree, as in test_jax_equivalence.py.
"""

import itertools
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers.common import SigtermAt
from tests.helpers.common import BACKEND
from tests.helpers.common import Stop
from tests.helpers.common import StopAt
from tests.helpers.common import tower_devices
from tests.helpers.doctests import examples_of
from tests.helpers.doctests import run_examples

import kerastower as kt
from kerastower.inputs import dealing
from kerastower.inputs import python_sources

B = 8
SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# What stock Keras reads of a PyDataset before training (and kerastower as it,
# tests/shared/test_ecosystem_pydataset.py): batches 0 and 1 for the spec on
# TensorFlow, the build batch (in a pass of its own) on JAX; and the calls of
# on_epoch_begin / on_epoch_end that come with it.
READ_FIRST = [0, 1] if BACKEND == "tensorflow" else [0]
HOOKS_FIRST = (0, 1) if BACKEND == "tensorflow" else (1, 1)


def _with_first(begun, ended):
    return begun + HOOKS_FIRST[0], ended + HOOKS_FIRST[1]


def _arrays(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = rng.integers(0, 3, n).astype("int32")
    w = rng.uniform(0.1, 2.0, n).astype("float32")
    return x, y, w


def _cut(arrays, sizes):
    """The arrays as consecutive batches of `sizes` examples, in order."""
    ends = np.cumsum(sizes)[:-1]
    return list(zip(*[np.split(a, ends) for a in arrays]))


class Batches(keras.utils.PyDataset):
    """A PyDataset over a list of batches; notes what is read and when."""

    def __init__(self, batches, **kwargs):
        super().__init__(**kwargs)
        self.batches = batches
        self.read = []
        self.threads = set()
        self.thread_kinds = set()
        self.begun = 0
        self.ended = 0

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, index):
        self.read.append(index)
        self.threads.add(threading.current_thread().name)
        self.thread_kinds.add(type(threading.current_thread()).__name__)
        return self.batches[index]

    def on_epoch_begin(self):
        self.begun += 1

    def on_epoch_end(self):
        self.ended += 1


class EndlessBatches(keras.utils.PyDataset):
    """A PyDataset without end: batch i holds examples of seed i."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.read = []

    @property
    def num_batches(self):
        return None

    def __getitem__(self, index):
        self.read.append(index)
        x, y, _ = _arrays(B, seed=index)
        return x, y


class ReIterable:
    """An iterable (not an iterator): every iter() is a new pass."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return (b for b in self.batches)


def _generator(batches):
    yield from batches


def _dense(towers, initial=None):
    with kt.distributed("mirrored", devices=tower_devices(towers)):
        keras.utils.set_random_seed(7)
        inputs = keras.Input((6,))
        h = keras.layers.Dense(8, activation="tanh")(inputs)
        model = kt.TowerModel(inputs, keras.layers.Dense(3)(h))
        model.compile(optimizer=keras.optimizers.Adam(0.03), loss=SCCE, metrics=["accuracy"])
        model(np.zeros((1, 6), "float32"))
        if initial is not None:
            model.set_weights(initial)
    return model


# name: (batch sizes, with sample weights, epochs, the source from the batches)
SOURCES = {
    "generator": ([B] * 14, False, 1, _generator),
    "iterable": ([B] * 13 + [5], True, 2, ReIterable),
    "pydataset": ([B] * 13 + [5], False, 2, Batches),
    "pydataset_workers": ([B] * 13 + [5], True, 2, lambda batches: Batches(batches, workers=3)),
}


# Every kind of source on 2 towers; on 4, the re-iterable (weighted, a short
# last batch): how a tower's batches are dealt does not depend on the kind.
@pytest.mark.parametrize("kind,towers", [(kind, 2) for kind in sorted(SOURCES)] + [("iterable", 4)])
def test_towers_on_a_source_equal_one_device_on_the_joined_batches(kind, towers):
    sizes, weighted, epochs, make = SOURCES[kind]
    arrays = _arrays(sum(sizes))[:3 if weighted else 2]
    one = _dense(1)
    initial = [np.array(w) for w in one.get_weights()]
    many = _dense(towers, initial)
    # Step s of N towers takes batches sN..sN+N-1: N x B consecutive examples,
    # which is one device's step s on the arrays with batch N x B. With 14
    # batches the last step has 2 (4 towers: it runs on 2) or, when the last
    # batch is short, batches of two sizes (they run joined, on one tower).
    one_logs = one.fit(*arrays[:2], sample_weight=arrays[2] if weighted else None,
                       batch_size=towers * B, epochs=epochs, shuffle=False,
                       verbose=0).history
    many_logs = many.fit(make(_cut(arrays, sizes)), epochs=epochs, shuffle=False,
                         verbose=0).history
    steps = -(-len(sizes) // towers)
    assert one.loop.global_step == many.loop.global_step == steps * epochs
    assert int(many.optimizer.iterations.numpy()) == steps * epochs
    moved = max(float(np.abs(a - w).max()) for a, w in zip(one.get_weights(), initial))
    assert moved > 1e-3, "training must move the weights for the comparison to mean anything"
    for a, b, w in zip(one.get_weights(), many.get_weights(), one.weights):
        np.testing.assert_allclose(b, a, atol=1e-5, err_msg=f"{kind}: {w.path}")
    assert sorted(one_logs) == sorted(many_logs) == ["accuracy", "loss"]
    for key in one_logs:
        assert len(many_logs[key]) == epochs
        np.testing.assert_allclose(many_logs[key], one_logs[key], atol=1e-5, err_msg=f"logged {key}")


@pytest.mark.parametrize("towers", [2, 3])
@pytest.mark.parametrize("kind", ["generator", "pydataset"])
def test_evaluate_and_predict_from_a_source_count_each_batch_once_in_order(kind, towers):
    sizes = [B, B, B, B, 3]   # 2 towers: 2, 2, then 1 batch; 3 towers: 3, then 8 + 3 joined
    x, y, _ = _arrays(sum(sizes), seed=3)
    model = _dense(towers)
    make = _generator if kind == "generator" else Batches
    predictions = model.predict(make([b[0] for b in _cut((x,), sizes)]), verbose=0)
    got = model.evaluate(make(_cut((x, y), sizes)), return_dict=True, verbose=0)
    expected = model.evaluate(x, y, batch_size=len(x), return_dict=True, verbose=0)
    # Tower k's outputs of step s are batch sN+k's: in the source's order.
    np.testing.assert_allclose(predictions, np.asarray(model(x)), atol=1e-5)
    assert sorted(got) == sorted(expected)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], atol=1e-6, err_msg=key)


def test_evaluate_with_steps_takes_exactly_steps_x_towers_batches():
    taken = []

    def batches():
        for i in itertools.count():
            taken.append(i)
            yield _arrays(B, seed=i)[:2]

    model = _dense(2)
    model.evaluate(batches(), steps=3, verbose=0)
    assert model.predict((b[0] for b in batches()), steps=2, verbose=0).shape == (2 * 2 * B, 3)
    assert taken == list(range(6)) + list(range(4))


@pytest.mark.parametrize("make", [lambda: itertools.repeat(_arrays(B)[:2]), EndlessBatches],
                         ids=["itertools.repeat", "endless PyDataset"])
def test_an_endless_source_needs_steps(make):
    model = _dense(2)
    with pytest.raises(kt.InputSourceError, match="never ends.*steps_per_epoch"):
        model.fit(make(), verbose=0)
    with pytest.raises(kt.InputSourceError, match="never ends.*steps="):
        model.evaluate(make(), verbose=0)
    with pytest.raises(kt.InputSourceError, match="never ends.*steps="):
        model.predict(make(), verbose=0)
    assert model.loop.global_step == 0


def test_steps_per_epoch_takes_exactly_towers_batches_a_step_from_an_endless_generator():
    taken = []

    def endless():
        for i in itertools.count():
            taken.append(i)
            yield _arrays(B, seed=i)[:2]

    model = _dense(2)
    model.fit(endless(), steps_per_epoch=3, epochs=2, verbose=0)
    assert model.loop.global_step == 6
    assert taken == list(range(12))   # 6 steps x 2 towers, nothing read ahead
    source = EndlessBatches()
    model = _dense(4)
    model.fit(source, steps_per_epoch=2, epochs=3, verbose=0)
    assert model.loop.global_step == 6
    assert source.read == READ_FIRST + list(range(24))


def test_a_generator_that_runs_out_before_steps_per_epoch_says_so():
    model = _dense(2)
    with pytest.raises(kt.InputSourceError, match="ran out after 2 of steps_per_epoch=3"):
        model.fit(_generator(_cut(_arrays(4 * B), [B] * 4)), steps_per_epoch=3, verbose=0)
    # An epoch that is one pass: a used-up generator gives the second nothing.
    with pytest.raises(kt.InputSourceError, match="no batch at all"):
        model.fit(_generator(_cut(_arrays(4 * B), [B] * 4)), epochs=2, verbose=0)


def test_a_pydataset_is_read_in_index_order_with_on_epoch_end_once_per_epoch():
    batches = _cut(_arrays(5 * B), [B] * 5)
    source = Batches(batches)
    model = _dense(2)
    history = model.fit(source, epochs=3, shuffle=False, verbose=0)
    assert model.loop.global_step == 9            # ceil(5 / 2) steps an epoch
    assert source.read == READ_FIRST + [0, 1, 2, 3, 4] * 3
    assert (source.begun, source.ended) == _with_first(3, 3)
    assert len(history.history["loss"]) == 3


def test_a_pydataset_with_steps_per_epoch_goes_on_pass_after_pass():
    source = Batches(_cut(_arrays(3 * B), [B] * 3))
    model = _dense(2)
    model.fit(source, steps_per_epoch=2, epochs=2, shuffle=False, verbose=0)
    # 4 steps: (0, 1), (2), (0, 1), (2); each epoch ends with on_epoch_end.
    assert model.loop.global_step == 4
    assert source.read == READ_FIRST + [0, 1, 2, 0, 1, 2]
    assert (source.begun, source.ended) == _with_first(2, 2)


def test_fit_shuffles_a_pydataset_batch_order_every_epoch_as_keras_does():
    source = Batches(_cut(_arrays(8 * B), [B] * 8))
    model = _dense(2)
    model.fit(source, epochs=3, verbose=0)   # shuffle=True, Keras's default
    read = source.read[len(READ_FIRST):]
    epochs = [read[i:i + 8] for i in range(0, 24, 8)]
    assert all(sorted(e) == list(range(8)) for e in epochs)
    assert len({tuple(e) for e in epochs} | {tuple(range(8))}) == 4


def test_nested_inputs_tf_tensors_and_bare_x_items():
    rng = np.random.default_rng(9)
    a = rng.normal(size=(4 * B, 3)).astype("float32")
    b = rng.normal(size=(4 * B, 2)).astype("float32")
    y = rng.normal(size=(4 * B, 1)).astype("float32")

    def dict_model(towers):
        with kt.distributed("mirrored", devices=tower_devices(towers)):
            keras.utils.set_random_seed(3)
            ins = {"a": keras.Input((3,), name="a"), "b": keras.Input((2,), name="b")}
            out = keras.layers.Dense(1)(keras.layers.Concatenate()([ins["a"], ins["b"]]))
            model = kt.TowerModel(ins, out)
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    one, many = dict_model(1), dict_model(2)
    many.set_weights(one.get_weights())
    one.fit({"a": a, "b": b}, y, batch_size=2 * B, shuffle=False, verbose=0)

    def batches():   # lists, dicts and tf tensors, as a tf.data pipeline would give them
        for i in range(4):
            part = slice(i * B, (i + 1) * B)
            yield [{"a": tf.constant(a[part]), "b": b[part]}, tf.constant(y[part])]

    many.fit(batches(), verbose=0)
    predictions = many.predict(({"a": a[i:i + B], "b": b[i:i + B]} for i in range(0, 4 * B, B)),
                               verbose=0)
    for p, q in zip(one.get_weights(), many.get_weights()):
        np.testing.assert_allclose(q, p, atol=1e-6)
    np.testing.assert_allclose(predictions, np.asarray(many({"a": a, "b": b})), atol=1e-5)


def test_batches_of_one_step_that_do_not_fit_together_are_a_data_mismatch():
    model = _dense(2)
    with pytest.raises(kt.DataMismatchError, match="batch 1"):
        model.predict(_generator([np.ones((B, 6), "float32"), np.ones((B, 6, 1), "float32")]),
                      verbose=0)
    with pytest.raises(kt.DataMismatchError, match="same number of examples"):
        model.fit(_generator([(np.ones((B, 6)), np.ones((B - 1,)))]), verbose=0)


def test_sources_refuse_what_they_cannot_take():
    model = _dense(2)
    with pytest.raises(kt.InputSourceError, match="cannot become a numpy array"):
        model.predict(_generator([(object(),)]), verbose=0)
    with pytest.raises(kt.InputSourceError, match="y and sample_weight"):
        model.fit(_generator([]), np.ones(3), verbose=0)
    with pytest.raises(kt.InputSourceError, match="batch_size"):
        model.fit(Batches([]), batch_size=4, verbose=0)
    with pytest.raises(kt.InputSourceError, match="empty"):
        model.evaluate(_generator([]), verbose=0)


def test_validation_data_from_a_generator_with_arrays_to_train():
    x, y, _ = _arrays(4 * B, seed=5)
    model = _dense(2)
    history = model.fit(x, y, batch_size=B, epochs=1, verbose=0,
                        validation_data=_generator(_cut((x, y), [B] * 4)))
    expected = model.evaluate(x, y, batch_size=B, return_dict=True, verbose=0)
    np.testing.assert_allclose(history.history["val_loss"][0], expected["loss"], atol=1e-6)


def test_the_module_docstrings_run(tmp_path):
    modules = [dealing, python_sources]
    if BACKEND == "tensorflow":
        from kerastower.backend.tensorflow import python_input

        modules.append(python_input)
    tests = [t for m in modules for t in examples_of(m)]
    assert tests
    failures = run_examples(tests, tmp_path)
    assert not failures, failures[-3000:]


def test_a_pydataset_with_workers_is_read_ahead_by_keras_reader_threads_in_order():
    sizes = [B] * 9 + [3]
    batches = _cut(_arrays(sum(sizes))[:2], sizes)
    threaded = Batches(batches, workers=3, max_queue_size=4)
    plain = Batches(batches)
    trained = []
    for source in (threaded, plain):
        model = _dense(2)
        model.fit(source, epochs=2, shuffle=True, verbose=0)
        trained.append(model.get_weights())
    workers = threaded.threads - plain.threads - {"MainThread"}  # the main thread reads batch 0 to build
    assert len(workers) > 1
    # Keras's own reader reads: its PyDatasetAdapter's thread pool (multiprocessing.dummy).
    assert "DummyProcess" in threaded.thread_kinds
    # Without workers, no pool thread reads (on TensorFlow, tf.data's own do).
    assert "DummyProcess" not in plain.thread_kinds
    first = len(READ_FIRST)
    assert sorted(threaded.read[first:]) == sorted(plain.read[first:]) == sorted(list(range(10)) * 2)
    assert (threaded.begun, threaded.ended) == (plain.begun, plain.ended) == _with_first(2, 2)
    for got, want in zip(*trained):
        np.testing.assert_array_equal(got, want)


def _resumable(kind):
    """(the source, fit's keyword arguments) of each resumable Python source kind."""
    batches = _cut(_arrays(7 * B, seed=11)[:2], [B] * 7)
    if kind == "pydataset":     # shuffled, an epoch a pass of 4 steps (the last short)
        return Batches(batches), {"epochs": 3}
    if kind == "iterable":      # steps_per_epoch across passes, a short step each pass
        return ReIterable(batches), {"epochs": 3, "steps_per_epoch": 3}
    endless = (b for _ in range(10) for b in batches)   # one-shot, steps_per_epoch
    return endless, {"epochs": 3, "steps_per_epoch": 3, "shuffle": False}


def _train_resumable(folder, kind, extra=(), epochs=None):
    keras.utils.set_random_seed(42)
    source, kwargs = _resumable(kind)
    if epochs:
        kwargs["epochs"] = epochs
    model = _dense(2)
    callbacks = [kt.callbacks.AutoResume(folder),
                 kt.callbacks.PeriodicTrigger(kt.callbacks.ModelSaver(folder), every_k_steps=3),
                 *extra]
    model.fit(source, verbose=0, callbacks=callbacks, **kwargs)
    return model


@pytest.mark.parametrize("kind, stop_at", [("pydataset", 7), ("iterable", 8), ("generator", 7)])
def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, kind, stop_at):
    whole = _train_resumable(str(tmp_path / "a"), kind)
    with pytest.raises(Stop):
        _train_resumable(str(tmp_path / "b"), kind, [StopAt(stop_at)])
    assert kt.checkpoint.latest_checkpoint(str(tmp_path / "b")).endswith("ckpt-00000006")
    resumed = _train_resumable(str(tmp_path / "b"), kind)
    assert int(resumed.optimizer.iterations.numpy()) == int(whole.optimizer.iterations.numpy())
    for a, b in zip(whole.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Resumed without the input position, the batches would differ: the test can fail.
    shorter = _train_resumable(str(tmp_path / "c"), kind, epochs=2)
    assert any(not np.array_equal(a, b) for a, b in zip(whole.get_weights(), shorter.get_weights()))


@pytest.mark.parametrize("kind, stop_at", [("pydataset", 7), ("iterable", 8), ("generator", 7)])
def test_a_preempted_run_resumes_equal_to_an_uninterrupted_one(tmp_path, kind, stop_at):
    """SIGTERM mid-epoch saves that very step (not the last periodic save, 6)."""
    whole = _train_resumable(str(tmp_path / "a"), kind)
    with pytest.raises(kt.Preempted) as stopped:
        _train_resumable(str(tmp_path / "b"), kind, [SigtermAt(stop_at)])
    assert stopped.value.checkpoint.endswith(f"ckpt-{stop_at:08d}")
    resumed = _train_resumable(str(tmp_path / "b"), kind)
    assert int(resumed.optimizer.iterations.numpy()) == int(whole.optimizer.iterations.numpy())
    for a, b in zip(whole.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_pydataset_of_two_towers_resumes_on_one_at_the_same_source_batch(tmp_path, capsys):
    """A source that makes its own batches keeps its position in them on
    another number of towers: 2 towers took 8 of 12 batches; 1 tower goes on
    with batch 8, exactly as the checkpoint's weights and optimizer trained
    on batches 8 to 11 would."""
    batches = _cut(_arrays(12 * B, seed=5)[:2], [B] * 12)
    folder = str(tmp_path / "ckpt")
    with pytest.raises(kt.Preempted) as stopped:
        _dense(2).fit(Batches(batches), epochs=1, verbose=0, shuffle=False,
                      callbacks=[kt.callbacks.AutoResume(folder), SigtermAt(4)])
    resumed = _dense(1)
    capsys.readouterr()
    resumed.fit(Batches(batches), epochs=1, verbose=1, shuffle=False,
                callbacks=[kt.callbacks.AutoResume(folder)])
    said = capsys.readouterr().out
    assert ("The checkpoint was written by 2 tower(s) x the source's batch; this run has 1 "
            "tower(s) x the source's batch") in said, said
    assert "The input goes on at source batch 8 of the pass (the source's batches are counted" in said
    assert resumed.loop.global_step == 4 + 4
    reference = _dense(1)
    with reference.tower_strategy.scope():
        reference.optimizer.build(reference.trainable_variables)
    kt.checkpoint.read_checkpoint(stopped.value.checkpoint, reference)
    reference.fit(Batches(batches[8:]), epochs=1, verbose=0, shuffle=False)
    for a, b in zip(reference.get_weights(), resumed.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_tf_data_dataset_is_read_as_keras_reads_it_on_each_backend():
    """On TensorFlow a pipeline; on JAX an iterable of numpy batches (as Keras
    reads it there), iterated afresh every pass."""
    x, y, _ = _arrays(6 * B, seed=8)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
    one, many = _dense(1), _dense(2)
    many.set_weights(one.get_weights())
    one.fit(x, y, batch_size=2 * B, epochs=2, shuffle=False, verbose=0)
    many.fit(dataset, epochs=2, verbose=0)
    assert many.loop.global_step == 6
    for a, b in zip(one.get_weights(), many.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-5)


class _PidBatches(Batches):
    """Batches that note, in a file, the process that read each."""

    def __init__(self, batches, folder, **kwargs):
        super().__init__(batches, **kwargs)
        self.folder = folder

    def __getitem__(self, index):
        import os

        with open(os.path.join(self.folder, f"{index}-{os.getpid()}"), "w"):
            pass
        return self.batches[index]


def test_a_pydataset_with_use_multiprocessing_is_read_by_worker_processes(tmp_path):
    import os

    sizes = [B] * 7 + [3]
    batches = _cut(_arrays(sum(sizes))[:2], sizes)
    trained = []
    for source in (_PidBatches(batches, str(tmp_path), workers=2, use_multiprocessing=True,
                               max_queue_size=3),
                   Batches(batches)):
        model = _dense(2)
        model.fit(source, epochs=2, shuffle=True, verbose=0)
        trained.append(model.get_weights())
    readers = {name.split("-")[1] for name in os.listdir(tmp_path)}
    assert readers - {str(os.getpid())}, "worker processes read the batches"
    for got, want in zip(*trained):
        np.testing.assert_array_equal(got, want)
