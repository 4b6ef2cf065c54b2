"""JAX: the next call launched before this one's finite flags are read.

With the NaN check on, a step's callbacks wait for its finite flag; the
engine launches the next call first (`TowerSteps.launches_ahead`),
so the host's work overlaps the device's. What callbacks see and do must
not change: each test runs the same fit with the check on (launching
ahead) and off (no flag to wait for, nothing launched ahead), from the same
weights on the same batches, and compares.
"""

import keras
import numpy as np
import pytest

import kerastower as kt
from kerastower.errors import NonFiniteError


def _data(n=96):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 5)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


def _pair(devices=(0,)):
    """Two models with the same weights: the check on, and off."""
    models = []
    for check in (True, False):
        keras.utils.set_random_seed(3)
        with kt.distributed("single" if len(devices) == 1 else "mirrored", devices=list(devices)):
            inputs = keras.Input((5,))
            h = keras.layers.Dense(8, activation="relu")(inputs)
            model = kt.TowerModel(inputs, keras.layers.Dense(2)(h))
            model.compile(optimizer="adam", loss="mse", metrics=["mae"], check_finite=check)
        models.append(model)
    return models


def _launched_ahead(model):
    return model.engine.tower_steps().launches_ahead()


def _assert_same_weights(a, b):
    for x, y in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)


class _BatchLog(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


@pytest.mark.parametrize("devices", [(0,), (0, 1)])
def test_launching_ahead_changes_no_weight_and_no_batch_log(devices):
    checked, unchecked = _pair(devices)
    x, y = _data()
    logs = {}
    for model in (checked, unchecked):
        logs[model] = _BatchLog()
        keras.utils.set_random_seed(7)  # the same shuffle
        model.fit(x, y, batch_size=8, epochs=3, shuffle=True, verbose=0, callbacks=[logs[model]])
    assert _launched_ahead(checked)
    assert not _launched_ahead(unchecked)
    _assert_same_weights(checked, unchecked)
    np.testing.assert_allclose(logs[checked].losses, logs[unchecked].losses, rtol=0, atol=1e-6)
    assert int(checked.optimizer.iterations) == int(unchecked.optimizer.iterations) == 3 * 96 // (8 * len(devices))


class _HalveKernelAt(keras.callbacks.Callback):
    """Reads and sets a weight at one batch's end (Keras syncs the state
    when `self.model` is read); the next step must start from it."""

    def __init__(self, batch):
        super().__init__()
        self.batch = batch
        self.seen = None

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            kernel = self.model.layers[-1].kernel
            self.seen = np.array(kernel.value)
            kernel.assign(kernel.value * 0.5)


def test_a_weight_a_callback_sets_reaches_the_next_step_launched_ahead_or_not():
    checked, unchecked = _pair()
    x, y = _data()
    seen = {}
    for model in (checked, unchecked):
        callback = _HalveKernelAt(batch=4)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
        seen[model] = callback.seen
    # The callback saw the weights after its own batch, not a step later...
    np.testing.assert_allclose(seen[checked], seen[unchecked], rtol=0, atol=1e-6)
    # ...and the steps after it started from the halved kernel.
    _assert_same_weights(checked, unchecked)
    assert int(checked.optimizer.iterations) == 12


class _StopAt(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            self.model.stop_training = True


def test_a_stop_at_a_batch_drops_the_call_launched_after_it():
    checked, unchecked = _pair()
    x, y = _data()
    for model in (checked, unchecked):
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[_StopAt(5)])
    assert _launched_ahead(checked)
    assert int(checked.optimizer.iterations) == int(unchecked.optimizer.iterations) == 6
    assert checked.loop.global_step == 6
    _assert_same_weights(checked, unchecked)


def test_a_nonfinite_step_leaves_the_last_finite_state_with_a_call_launched_after_it():
    checked, unchecked = _pair()
    x, y = _data()
    y_bad = y.copy()
    y_bad[40] = np.inf  # the sixth batch of 8
    checked.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    unchecked.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    with pytest.raises(NonFiniteError):
        # A callback reads each step, so each call's flags are waited for
        # and the next call is launched ahead meanwhile.
        checked.fit(x, y_bad, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[_BatchLog()])
    unchecked.fit(x[:40], y[:40], batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert _launched_ahead(checked)
    _assert_same_weights(checked, unchecked)
    assert int(checked.optimizer.iterations) == int(unchecked.optimizer.iterations) == 12 + 5


@pytest.mark.parametrize("check_finite", [True, False])
def test_later_epochs_and_fits_reuse_the_one_compiled_step(check_finite):
    from tests.jax.helpers import TowerRecorder

    recorder = TowerRecorder()
    with kt.distributed("single", devices=[0]):
        inputs = keras.Input((5,))
        model = kt.TowerModel(inputs, keras.layers.Dense(2)(recorder(inputs)))
        model.compile(optimizer="adam", loss="mse", check_finite=check_finite)
    x, y = _data()
    for _ in range(3):
        model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    # The state the steps give back is placed as the first step's was, so
    # no later call compiles the step again.
    assert len([c for c in recorder.contexts if c[2].startswith("tower")]) == 1
    assert int(model.optimizer.iterations) == 3 * 2 * 12


def test_every_call_launched_ahead_is_used_when_no_callback_sets_a_weight():
    checked, _ = _pair()
    x, y = _data()
    checked.fit(x, y, batch_size=8, epochs=1, verbose=0)
    tower_steps = checked.engine.tower_steps()
    launches = []
    launch = tower_steps.launch
    tower_steps.launch = lambda *args, **kwargs: launches.append(1) or launch(*args, **kwargs)

    class ReadsTheWeights(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.get_weights()  # a sync: the state stays the steps'

    checked.fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[ReadsTheWeights()])
    # 2 epochs of 12 steps, each launched once: none dropped and run again.
    assert len(launches) == 24


def _flag_reads(monkeypatch, model):
    """Spies on the real `first_nonfinite_step`: for each read of a call's
    flags, the steps the loop had counted, and whether it had ended the
    epoch's steps."""
    from kerastower.backend.jax import step as jax_step

    reads = []
    read = jax_step.first_nonfinite_step

    def spy(finite):
        if finite is not None:
            reads.append((model.loop.global_step, model.loop.epoch_ended))
        return read(finite)

    monkeypatch.setattr(jax_step, "first_nonfinite_step", spy)
    return reads


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_a_calls_flags_are_read_after_the_next_call_is_launched_unless_a_callback_reads_steps(
        monkeypatch, steps_per_execution):
    """Where no callback reads a step, a call's flags are read once the
    next call (gated on them on the devices) is launched, or at the epoch's
    end: the host never waits for the call it just launched."""
    checked, unchecked = _pair()
    for model in (checked, unchecked):
        model.compile(optimizer="adam", loss="mse", metrics=["mae"],
                      check_finite=model is checked, steps_per_execution=steps_per_execution)
    x, y = _data()
    reads = _flag_reads(monkeypatch, checked)
    histories = [model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
                 for model in (checked, unchecked)]
    calls = 12 // steps_per_execution
    # Call k's flags are read in call k + 1 (the loop has counted k), the
    # epoch's last call's at the epoch's end.
    assert reads == [(12 * epoch + steps_per_execution * k, k == calls)
                     for epoch in range(2) for k in range(1, calls + 1)]
    _assert_same_weights(checked, unchecked)
    np.testing.assert_allclose(histories[0].history["loss"], histories[1].history["loss"], atol=1e-6)
    assert checked.loop.global_step == unchecked.loop.global_step == 24
    assert checked.loop.tower_batches == unchecked.loop.tower_batches == [12]
    # A callback with a batch hook: each call's flags are read before the
    # loop counts it and runs its callbacks.
    reads.clear()
    checked.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[_BatchLog()])
    assert reads == [(24 + steps_per_execution * k, False) for k in range(calls)]
    # A progress bar (kerastower's, fit's verbose=1, or Keras's) only shows
    # each step's logs: the flags are still read late.
    for progress_bar in ([], [keras.callbacks.ProgbarLogger()]):
        reads.clear()
        start = checked.loop.global_step
        checked.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=1, callbacks=progress_bar)
        assert reads == [(start + steps_per_execution * k, k == calls) for k in range(1, calls + 1)]


@pytest.mark.parametrize("width,reads_steps", [(8, False), (8, True), (512, False), (512, True),
                                               (8, "progress bar"), (512, "progress bar")])
def test_a_nonfinite_call_gates_the_call_launched_before_its_flags_were_read(width, reads_steps):
    """Call k + 1 is launched before call k's flags are read: where no
    callback reads a step (its flags are read late), with a state each
    call takes as its own (donated); where one does, launched ahead with
    a state it does not take (small), else not at all (wide, donated).
    When call k was not finite, call k + 1 changes nothing, and the
    weights are those of the step before k."""
    x, y = _data()
    y_bad = y.copy()
    y_bad[40] = np.inf   # the sixth batch of 8
    models = []
    for _ in range(2):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((5,))
        h = keras.layers.Dense(width, activation="relu")(inputs)
        h = keras.layers.Dense(width, activation="relu")(h)
        model = kt.TowerModel(inputs, keras.layers.Dense(2)(h))
        model.compile(optimizer="adam", loss="mse")
        models.append(model)
    failing, reference = models
    with pytest.raises(NonFiniteError) as caught:
        failing.fit(x, y_bad, batch_size=8, epochs=1, shuffle=False,
                    verbose=int(reads_steps == "progress bar"),
                    callbacks=[_BatchLog()] if reads_steps is True else [])
    reference.fit(x[:40], y[:40], batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert _launched_ahead(failing) == (width == 8 and reads_steps is True)

    assert caught.value.global_step == 6 and failing.loop.global_step == 5
    assert int(failing.optimizer.iterations) == 5
    _assert_same_weights(failing, reference)


def test_an_error_in_the_next_call_still_reports_the_nonfinite_call_before_it(monkeypatch):
    """Call 2's flags are unread when launching call 3 fails (no callback
    reads a step: a call's flags are read once the next is launched): the
    NonFiniteError of call 2 is the one reported, with the counts of the
    step before it."""
    from kerastower.backend.jax import step as jax_step

    x, y = _data()
    y_bad = y.copy()
    y_bad[8] = np.inf   # the second batch of 8
    model, _ = _pair()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    launch = jax_step.TowerSteps.launch
    launches = []

    def failing_launch(self, *args, **kwargs):
        launches.append(None)
        if len(launches) == 3:
            raise RuntimeError("the third launch fails")
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(jax_step.TowerSteps, "launch", failing_launch)
    with pytest.raises(NonFiniteError) as caught:
        model.fit(x, y_bad, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert isinstance(caught.value.__context__, RuntimeError)
    assert caught.value.global_step == 12 + 2 and model.loop.global_step == 12 + 1


class _TieAtEpochEnd(keras.callbacks.Callback):
    """Sets one layer's kernel to another's at each epoch's end: Keras's
    `assign` of a variable stores its array, so two variables hold one."""

    def on_epoch_end(self, epoch, logs=None):
        self.model.layers[2].kernel.assign(self.model.layers[1].kernel)


def _tied_model(ema):
    keras.utils.set_random_seed(3)
    with kt.distributed("mirrored", devices=[0, 1]):
        inputs = keras.Input((5,))
        h = keras.layers.Dense(5, activation="relu")(inputs)
        h = keras.layers.Dense(5, activation="relu")(h)
        model = kt.TowerModel(inputs, keras.layers.Dense(2)(h))
        model.compile(optimizer=keras.optimizers.SGD(0.01, use_ema=ema), loss="mse")
    return model


@pytest.mark.parametrize("ema", [False, True])
def test_two_variables_holding_one_array_train_as_when_the_steps_do_not_take_their_state(ema):
    """Where no callback reads a step, the steps take their state as their
    own (donated); an array two variables hold (tied at an epoch's end, or
    the optimizer's EMA written into the weights when a fit ends) is
    copied first, and training is what it is where the state is not taken
    (a batch callback: launched ahead)."""
    x, y = _data()
    results = []
    for reads_steps in (False, True):
        model = _tied_model(ema)
        for _ in range(2):
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
                      callbacks=[_TieAtEpochEnd()] + ([_BatchLog()] if reads_steps else []))
        assert _launched_ahead(model) == reads_steps
        results.append(model)
    _assert_same_weights(*results)


class _RefusesShortBatches(kt.TowerModel):
    def train_step(self, state, data):
        if keras.tree.flatten(data)[0].shape[0] < 8:
            raise ValueError("this step takes batches of 8")
        return super().train_step(state, data)


def test_a_step_that_fails_while_traced_leaves_the_last_steps_weights():
    """The short last step of a pass is traced anew and fails there, before
    the call could take the towers' state: the towers keep the state of the
    step before it, and the model's weights are those."""
    x, y = _data(20)   # steps of 8, 8 and 4 examples
    models = []
    for _ in range(2):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((5,))
        model = _RefusesShortBatches(inputs, keras.layers.Dense(2)(inputs))
        model.compile(optimizer="adam", loss="mse")
        models.append(model)
    failing, reference = models
    with pytest.raises(Exception, match="batches of 8"):
        failing.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert not _launched_ahead(failing)
    reference.fit(x[:16], y[:16], batch_size=8, epochs=1, shuffle=False, verbose=0)
    _assert_same_weights(failing, reference)
