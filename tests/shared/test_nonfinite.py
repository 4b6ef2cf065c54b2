"""A step whose gradients hold NaN or Inf stops training, on both backends
alike: its update is not applied (BatchNormalization's statistics
included), and the error names the step and the tower (also while fit, on
JAX, reads the next step's batches ahead)."""

import keras
import numpy as np
import pytest

import kerastower as kt

from tests.helpers.common import tower_devices


def _model(check_finite=True):
    with kt.distributed("mirrored", devices=tower_devices(2)):
        inputs = keras.Input((3,))
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", check_finite=check_finite)
    return model


def _data():
    x = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    x_bad = x.copy()
    x_bad[13] = np.inf  # step 2 (examples 8-15), tower 1 (examples 12-15)
    return x, y, x_bad


def _assert_weights_after_the_good_step(model, start, x, y):
    """`model` holds the weights of `start` trained on the first, finite step only."""
    reference = _model()
    reference.set_weights(start)
    reference.fit(x[:8], y[:8], batch_size=4, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)
        assert np.isfinite(got).all()


def test_a_nonfinite_step_stops_training_with_the_weights_of_the_step_before():
    x, y, x_bad = _data()
    model = _model()
    start = [w.copy() for w in model.get_weights()]
    with pytest.raises(kt.NonFiniteError) as caught:
        model.fit(x_bad, y, batch_size=4, shuffle=False, verbose=0)
    assert caught.value.global_step == 2 and caught.value.towers == [1]
    assert model.loop.global_step == 1
    _assert_weights_after_the_good_step(model, start, x, y)


def test_check_finite_false_applies_the_step():
    x, y, x_bad = _data()
    model = _model(check_finite=False)
    model.fit(x_bad, y, batch_size=4, shuffle=False, verbose=0)
    assert model.loop.global_step == 4
    assert not np.isfinite(model.get_weights()[0]).all()


def _batchnorm_model(steps_per_execution, weights=None):
    with kt.distributed("mirrored", devices=tower_devices(2)):
        inputs = keras.Input((3,))
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(keras.layers.BatchNormalization()(inputs)))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                      steps_per_execution=steps_per_execution)
    if weights is not None:
        model.set_weights(weights)
    return model


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_a_nonfinite_step_leaves_batchnorm_statistics_as_they_were(steps_per_execution):
    x, y, _ = _data()
    x_bad = x.copy()
    x_bad[9] = np.inf   # step 2 (examples 8-15), tower 0 (8-11), whose statistics are kept
    model = _batchnorm_model(steps_per_execution)
    start = model.get_weights()
    with pytest.raises(kt.NonFiniteError):
        model.fit(x_bad, y, batch_size=4, shuffle=False, verbose=0)
    reference = _batchnorm_model(1, start)
    reference.fit(x[:8], y[:8], batch_size=4, shuffle=False, verbose=0)   # the good step alone
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_terminate_on_nan_at_an_epochs_first_step_logs_nan_not_zero():
    """No step of the epoch was applied: its logs say NaN (they said 0.0 on
    JAX, the metrics put back to their reset values, and were missing
    when the run's first step failed)."""
    x, y, _ = _data()
    x_bad = x.copy()
    x_bad[0] = np.inf   # the first step
    model = _model()
    history = model.fit(x_bad, y, batch_size=4, shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.TerminateOnNaN()])
    assert model.loop.global_step == 0
    assert len(history.history["loss"]) == 1 and np.isnan(history.history["loss"][0])


class _Ends(keras.callbacks.Callback):
    """Notes whether on_train_end ran."""

    ended = False

    def on_train_end(self, logs=None):
        self.ended = True


def test_terminate_on_nan_with_raise_error_raises_keras_error_with_the_last_finite_weights():
    x, y, x_bad = _data()   # step 2 is not finite
    model = _model()
    start = [w.copy() for w in model.get_weights()]
    ends = _Ends()
    with pytest.raises(RuntimeError, match="NaN or Inf loss encountered at batch 1") as caught:
        model.fit(x_bad, y, batch_size=4, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.TerminateOnNaN(raise_error=True), ends])
    assert isinstance(caught.value.__cause__, kt.NonFiniteError)
    assert not ends.ended   # as Keras: raise_error bypasses the callbacks' on_train_end
    assert model.loop.global_step == 1
    _assert_weights_after_the_good_step(model, start, x, y)


def test_terminate_on_nan_ends_fit_normally_as_keras_does():
    x, y, x_bad = _data()
    model = _model()
    ends = _Ends()
    history = model.fit(x_bad, y, batch_size=4, shuffle=False, epochs=3, verbose=0,
                        callbacks=[keras.callbacks.TerminateOnNaN(), ends])
    assert ends.ended and model.stop_training
    assert model.loop.global_step == 1 and len(history.history["loss"]) == 1


class _EpochEnds(keras.callbacks.Callback):
    """An epoch-end hook only: nothing reads a step before its epoch's end
    (on JAX, a call then comes back before its finite flags are read, and
    the loop's counts are set back when they are)."""

    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(epoch)


def _spe_model(steps_per_execution, weights):
    with kt.distributed("mirrored", devices=tower_devices(2)):
        inputs = keras.Input((3,))
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                      steps_per_execution=steps_per_execution)
    model.set_weights(weights)
    return model


@pytest.mark.parametrize("steps_per_execution,bad_row,failed_step,towers", [
    (1, 29, 4, [1]),   # the epoch's last step, tower 1 (examples 28-31)
    (1, 13, 2, [1]),   # a step inside the epoch (examples 8-15)
    (2, 25, 4, [0]),   # the second step of the epoch's last call, tower 0 (24-27)
    (2, 17, 3, [0]),   # the first step of the epoch's last call
    (2, 1, 1, [0]),    # the epoch's first call
])
def test_a_nonfinite_step_with_no_callback_reading_steps_stops_there_with_every_count_before_it(
        steps_per_execution, bad_row, failed_step, towers):
    x, y, _ = _data()
    start = _model().get_weights()
    x_bad = x.copy()
    x_bad[bad_row] = np.inf
    model = _spe_model(steps_per_execution, start)
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)   # a first, finite epoch
    epochs = _EpochEnds()
    with pytest.raises(kt.NonFiniteError) as caught:
        model.fit(x_bad, y, batch_size=4, shuffle=False, verbose=0, callbacks=[epochs])
    done = failed_step - 1
    assert caught.value.global_step == 4 + failed_step and caught.value.towers == towers
    assert model.loop.global_step == 4 + done and model.loop.local_step == done
    # The failed step's batches were taken: the input's position is after them.
    assert model.loop.tower_batches == [failed_step, failed_step]
    assert model.loop.examples_seen == 32 + 8 * failed_step   # the first epoch's and these
    assert epochs.epochs == [] and not model.loop.epoch_ended   # the failed epoch did not end
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations.value)) == 4 + done
    reference = _spe_model(1, start)
    reference.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    reference.fit(x[:8 * done], y[:8 * done], batch_size=4, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_a_lambda_callbacks_batch_hook_never_sees_the_nonfinite_step():
    """LambdaCallback sets its hooks on the instance: it reads every step,
    so each call's flags are read before its batch-end hook runs."""
    x, y, x_bad = _data()   # step 2 is not finite
    model = _model()
    seen = []
    hook = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append((batch, model.loop.global_step)))
    with pytest.raises(kt.NonFiniteError) as caught:
        model.fit(x_bad, y, batch_size=4, shuffle=False, verbose=0, callbacks=[hook])
    assert caught.value.global_step == 2
    assert seen == [(0, 1)]


def test_a_terminate_on_nan_and_a_kt_callback_added_when_training_begins_act():
    """A callback may add others to the list in on_train_begin (as the
    loop asks for batch hooks after it): a TerminateOnNaN added there ends
    fit normally, and a kt callback added there gets its run hooks."""
    x, y, x_bad = _data()   # step 2 is not finite
    runs = []

    class CountsRuns(kt.callbacks.Callback):
        def _before_run(self):
            runs.append(self.global_step)

    class AddsThem(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            for added in (keras.callbacks.TerminateOnNaN(), CountsRuns()):
                added.set_model(self.model)
                callback_list.callbacks.append(added)

    model = _model()
    callback_list = keras.callbacks.CallbackList([AddsThem()], add_history=True, model=model)
    history = model.fit(x_bad, y, batch_size=4, shuffle=False, epochs=3, verbose=0,
                        callbacks=callback_list)
    assert model.stop_training and model.loop.global_step == 1
    assert len(history.history["loss"]) == 1
    assert runs == [0, 1]
