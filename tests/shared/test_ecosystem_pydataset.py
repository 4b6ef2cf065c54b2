"""A `keras.utils.PyDataset` behaves as in stock Keras (issue 53).

Stock Keras 3.15 calls a PyDataset's `on_epoch_begin` / `on_epoch_end` at
moments of its own: on TensorFlow it reads batches 0 and 1 for the
dataset's spec and calls `on_epoch_end` once after building (fit and
evaluate, not predict); on JAX it reads the batch it builds the model from
inside a pass of its own (`on_epoch_begin`, the batch, `on_epoch_end`),
and calls `on_epoch_end` alone where the model was built already. Each
epoch is then `on_epoch_begin`, the batches, `on_epoch_end` (by epoch,
not by pass, with `steps_per_epoch`; none for an epoch `stop_training`
breaks off); each validation is an `on_epoch_end` before the evaluation's
own pass; evaluate and predict end their pass with their `steps`. With
`shuffle=True` Keras permutes the batch indices with Python's `random`,
once a pass (once more on JAX for the build). A dataset that reshuffles
itself in `on_epoch_end` therefore trains in an order that depends on
every one of those calls.

Each test records the dataset's calls (and `__getitem__`'s indices) with
the callbacks' epoch hooks in one log, runs stock `keras.Model` and
`kt.TowerModel` alike, and compares logs, weights and what callbacks did.
N towers must read the dataset as stock Keras reads it on one device, and
train as one device on the joined batches.
"""

import functools
import os
import random

import keras
import numpy as np
import pytest

from tests.helpers.common import tower_devices

import kerastower as kt

B = 4          # examples in one batch of the base dataset (a tower's batch)


def _arrays(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.3).astype("float32")
    return x, y


X, Y = _arrays(6 * B, seed=0)
X_VAL, Y_VAL = _arrays(3 * B, seed=1)


class Recorded(keras.utils.PyDataset):
    """Batches of B rows, noting every call into `log` as (name, call[, index]).

    With `reshuffle_seed`, it permutes its own batches in every
    `on_epoch_end` (a numpy generator of its own), as many Keras programs
    do. `join` items make one batch: item i holds the base batches
    `order[join * i + k]`, so a dataset with `join=N` is what one device
    reads where N towers read the base dataset (its batches joined).
    `endless`: it never ends, item i being item `i % len(self)`."""

    def __init__(self, x, y, log, name="train", reshuffle_seed=None, join=1, endless=False,
                 **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.log, self.name, self.join = x, y, log, name, join
        self.endless = endless
        self.base = len(x) // B
        self.order = np.arange(self.base)
        self.rng = None if reshuffle_seed is None else np.random.default_rng(reshuffle_seed)

    def __len__(self):
        return -(-self.base // self.join)

    @property
    def num_batches(self):
        return None if self.endless else len(self)

    def __getitem__(self, index):
        self.log.append((self.name, "get", int(index)))
        index %= len(self)
        rows = np.concatenate([np.arange(b * B, (b + 1) * B) for b in
                               self.order[index * self.join:(index + 1) * self.join]])
        return self.x[rows], self.y[rows]

    def on_epoch_begin(self):
        self.log.append((self.name, "begin"))

    def on_epoch_end(self):
        self.log.append((self.name, "end"))
        if self.rng is not None:
            self.order = self.rng.permutation(self.base)


class EpochHooks(keras.callbacks.Callback):
    """Notes the callbacks' run and epoch hooks into `log`."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def _note(self, *what):
        self.log.append(("callback",) + what)

    def on_train_begin(self, logs=None):
        self._note("train_begin")

    def on_train_end(self, logs=None):
        self._note("train_end")

    def on_epoch_begin(self, epoch, logs=None):
        self._note("epoch_begin", epoch)

    def on_epoch_end(self, epoch, logs=None):
        self._note("epoch_end", epoch)

    def on_test_begin(self, logs=None):
        self._note("test_begin")

    def on_test_end(self, logs=None):
        self._note("test_end")

    def on_predict_begin(self, logs=None):
        self._note("predict_begin")

    def on_predict_end(self, logs=None):
        self._note("predict_end")


INITIAL = [np.random.default_rng(7).normal(size=shape).astype("float32") * 0.3
           for shape in ((3, 5), (5,), (5, 1), (1,))]


def _model(towers=None, learning_rate=0.05):
    """The same model and initial weights: stock Keras (`towers` None), or a
    TowerModel on `towers` towers."""

    def build(base):
        inputs = keras.Input((3,))
        hidden = keras.layers.Dense(5, activation="tanh")(inputs)
        model = base(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")
        model.set_weights(INITIAL)
        return model

    if towers is None:
        return build(keras.Model)
    with kt.distributed("mirrored", devices=tower_devices(towers)):
        return build(kt.TowerModel)


def _assert_weights(got, want, atol):
    for a, b in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_allclose(a, b, atol=atol, rtol=0)


@functools.cache  # stock Keras's (towers None) is the same for every parametrization
def _phases(towers):
    """The log of fit (PyDataset validation_data included), evaluate and
    predict, each from a fresh model and on a built one, as one list per
    call."""
    phases = []

    def record(call):
        log = []
        call(log)
        phases.append(log)

    def fit(log):
        model = _model(towers)
        model.fit(Recorded(X, Y, log), epochs=2, shuffle=False, verbose=0,
                  validation_data=Recorded(X_VAL, Y_VAL, log, name="val"),
                  callbacks=[EpochHooks(log)])
        log.append("evaluate on the built model")
        model.evaluate(Recorded(X, Y, log), verbose=0, callbacks=[EpochHooks(log)])
        log.append("predict on the built model")
        model.predict(Recorded(X, Y, log), verbose=0, callbacks=[EpochHooks(log)])
        log.append("fit again")
        model.fit(Recorded(X, Y, log), epochs=1, shuffle=False, verbose=0,
                  callbacks=[EpochHooks(log)])

    def evaluate_first(log):
        model = _model(towers)
        model.evaluate(Recorded(X, Y, log), verbose=0, callbacks=[EpochHooks(log)])

    def predict_first(log):
        model = _model(towers)
        model.predict(Recorded(X, Y, log), verbose=0, callbacks=[EpochHooks(log)])

    for call in (fit, evaluate_first, predict_first):
        record(call)
    return phases


@pytest.mark.parametrize("towers", [1, 2])
def test_the_hooks_are_called_as_stock_keras_calls_them(towers):
    """fit with a PyDataset validation_data, evaluate and predict: the same
    calls, in the same order, among the same callback hooks; N towers read
    the dataset as stock Keras does on one device."""
    want = _phases(None)
    got = _phases(towers)
    for name, g, w in zip(("fit", "evaluate first", "predict first"), got, want):
        assert g == w, f"{name} on {towers} tower(s):\n got {g}\nwant {w}"
    # The log holds what the issue is about: an on_epoch_end before the first epoch.
    fit_log = want[0]
    first_epoch = fit_log.index(("callback", "epoch_begin", 0))
    assert ("train", "end") in fit_log[:first_epoch]


def _fit_with_callbacks(model, dataset, folder, log):
    callbacks = [
        EpochHooks(log),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=0.02),
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=0.05),
        keras.callbacks.ModelCheckpoint(os.path.join(folder, "best-{epoch:02d}.weights.h5"),
                                        monitor="loss", save_best_only=True,
                                        save_weights_only=True),
    ]
    history = model.fit(dataset, epochs=12, shuffle=False, verbose=0, callbacks=callbacks,
                        validation_data=Recorded(X_VAL, Y_VAL, log, name="val"))
    return history.history


@pytest.mark.parametrize("towers", [1, 2])
def test_a_dataset_that_reshuffles_itself_trains_as_stock_keras(tmp_path, towers):
    """One tower equals stock Keras on the same dataset; 2 towers equal stock
    Keras on one device reading the joined batches (a dataset whose items
    are 2 of the base batches, reshuffled alike)."""
    want_log, got_log = [], []
    stock = _model(None, learning_rate=0.1)
    want = _fit_with_callbacks(stock, Recorded(X, Y, want_log, reshuffle_seed=3, join=towers),
                               str(tmp_path / "stock"), want_log)
    model = _model(towers, learning_rate=0.1)
    got = _fit_with_callbacks(model, Recorded(X, Y, got_log, reshuffle_seed=3),
                              str(tmp_path / "towers"), got_log)
    assert 2 < len(want["loss"]) < 12, "EarlyStopping should stop the run early"
    assert len(got["loss"]) == len(want["loss"])
    _assert_weights(model, stock, atol=1e-5)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, rtol=1e-5, err_msg=key)
    assert sorted(os.listdir(tmp_path / "towers")) == sorted(os.listdir(tmp_path / "stock"))

    def hooks(log):
        return [entry for entry in log if entry[1] != "get"]

    assert hooks(got_log) == hooks(want_log)
    if towers == 1:
        assert got_log == want_log


@pytest.mark.parametrize("towers", [1, 2])
def test_shuffle_with_the_seed_set_takes_stock_keras_batch_order(towers):
    """fit's default shuffle=True after keras.utils.set_random_seed: one
    tower reads the batches in stock Keras's order (from Python's `random`,
    which ends where stock Keras leaves it) and gives its weights; N towers
    read that same order, tower k of step s taking its batch s * N + k."""
    want_log, got_log = [], []
    stock = _model(None)
    keras.utils.set_random_seed(11)
    stock.fit(Recorded(X, Y, want_log), epochs=3, verbose=0)
    want_random = random.getstate()
    model = _model(towers)
    keras.utils.set_random_seed(11)
    model.fit(Recorded(X, Y, got_log), epochs=3, verbose=0)
    assert got_log == want_log
    epochs = [log for log in _split_epochs(want_log)]
    assert len({tuple(e) for e in epochs}) > 1, "the passes should be shuffled apart"
    assert random.getstate() == want_random
    if towers == 1:
        _assert_weights(model, stock, atol=1e-6)


def _split_epochs(log):
    """The indices read in each pass of `log`."""
    passes, current = [], None
    for entry in log:
        if entry[1] == "begin":
            current = []
        elif entry[1] == "end" and current is not None:
            passes.append(current)
            current = None
        elif entry[1] == "get" and current is not None:
            current.append(entry[2])
    return [p for p in passes if len(p) == len(X) // B]


class StopInSecondEpoch(keras.callbacks.Callback):
    """Sets stop_training after the first step of the second epoch (its
    `last` step)."""

    def __init__(self, last=False):
        super().__init__()
        self.last = last

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch == (self.params["steps"] - 1 if self.last else 0):
            self.model.stop_training = True


@functools.cache
def _hook_calls(towers):
    """The hooks' log (reads left out: stock Keras on TensorFlow reads a
    batch ahead) of fits with steps_per_epoch, fits that stop_training
    breaks off, and evaluate and predict with steps."""
    log = []
    model = _model(towers)

    def fit(note, dataset, **kwargs):
        log.append(note)
        callbacks = [EpochHooks(log)] + kwargs.pop("callbacks", [])
        model.fit(dataset, shuffle=False, verbose=0, callbacks=callbacks, **kwargs)

    fit("steps_per_epoch", Recorded(X, Y, log), epochs=3, steps_per_epoch=3)
    fit("endless", Recorded(X, Y, log, endless=True), epochs=2, steps_per_epoch=2)
    fit("stopped", Recorded(X, Y, log), epochs=3, callbacks=[StopInSecondEpoch()])
    fit("stopped at the last step", Recorded(X, Y, log), epochs=3,
        callbacks=[StopInSecondEpoch(last=True)])
    fit("stopped, steps_per_epoch", Recorded(X, Y, log, endless=True), epochs=3,
        steps_per_epoch=2, callbacks=[StopInSecondEpoch()])
    log.append("evaluate")
    model.evaluate(Recorded(X, Y, log), steps=2, verbose=0, callbacks=[EpochHooks(log)])
    model.evaluate(Recorded(X, Y, log, endless=True), steps=2, verbose=0,
                   callbacks=[EpochHooks(log)])
    log.append("predict")
    model.predict(Recorded(X, Y, log), steps=2, verbose=0, callbacks=[EpochHooks(log)])
    return [entry for entry in log if isinstance(entry, str) or entry[1] != "get"]


@pytest.mark.parametrize("towers", [1, 2])
def test_the_hooks_follow_the_epochs_and_steps_as_in_stock_keras(towers):
    """With steps_per_epoch, stock Keras calls the hooks by epoch, not by
    pass (an endless dataset too); an epoch that stop_training breaks off
    gets no on_epoch_end; evaluate and predict end their pass with their
    steps."""
    want = _hook_calls(None)
    got = _hook_calls(towers)
    # Each of the two sequences in stock's order; how the dataset's hooks
    # interleave with the callbacks' is not compared: stock Keras on
    # TensorFlow calls the dataset's from tf.data's reader thread, so the
    # interleaving changes with the machine's load.
    for kind in ("callback", None):
        def of_kind(log):
            return [entry for entry in log if isinstance(entry, str)
                    or (entry[0] == "callback") == (kind == "callback")]
        assert of_kind(got) == of_kind(want), kind or "the dataset's hooks"
    first_fit = want[want.index("steps_per_epoch"):want.index("endless")]
    epochs = first_fit[first_fit.index(("callback", "train_begin")):]
    assert epochs.count(("train", "begin")) == epochs.count(("train", "end")) == 3
