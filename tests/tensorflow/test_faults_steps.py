"""Faults inside training: non-finite steps, exact resume of one-pass epochs,
and the errors a failing input or step gives (issue 11, items 4, 5, 7)."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerastower as kt
from tests.tensorflow.helpers import TWO, Stop, StopAt, id_data
from kerastower.errors import NonFiniteError
from kerastower.errors import StepFailedError


def _regression_model(optimizer, steps_per_execution=1):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((4,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(inputs)))
    model.compile(optimizer=optimizer, loss="mse", steps_per_execution=steps_per_execution)
    return model


def _regression_data(nan_at=None):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    if nan_at is not None:
        x[nan_at, 1] = np.nan
    return x, y


# -- item 4: a non-finite step stops training, weights stay finite ---------------

@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_a_nan_on_one_tower_stops_at_that_step_naming_it(steps_per_execution):
    # Step 4 (0-based 3) takes examples 24..31; tower 1 takes 28..31.
    x, y = _regression_data(nan_at=29)
    with kt.distributed("mirrored", devices=TWO):
        model = _regression_model(keras.optimizers.Adam(0.01), steps_per_execution)
        with pytest.raises(NonFiniteError, match=r"step 4 .*on tower 1 of 2") as caught:
            model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert caught.value.global_step == 4 and caught.value.towers == [1]
    assert model.loop.global_step == 3
    assert int(model.optimizer.iterations.numpy()) == 3
    # The weights are those after step 3: as a run of 3 steps on clean data.
    clean_x, clean_y = _regression_data()
    with kt.distributed("mirrored", devices=TWO):
        reference = _regression_model(keras.optimizers.Adam(0.01))
        reference.fit(clean_x[:24], clean_y[:24], batch_size=4, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_loss_scale_optimizer_skips_the_step_and_training_goes_on():
    x, y = _regression_data(nan_at=29)
    with kt.distributed("mirrored", devices=TWO):
        model = _regression_model(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01)))
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert model.loop.global_step == 8  # the skipped step counts
    assert int(model.optimizer.iterations.numpy()) == 7
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_check_finite_false_applies_every_step_as_stock_keras_does():
    """compile(check_finite=False) drops the per-step check: a NaN step is
    applied (the weights become NaN, as in stock Keras) and training goes on;
    finite steps give the same weights as with the check."""
    x, y = _regression_data(nan_at=29)
    with kt.distributed("mirrored", devices=TWO):
        model = _regression_model(keras.optimizers.SGD(0.01))
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", check_finite=False)
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert model.loop.global_step == 8
    assert not all(np.isfinite(w).all() for w in model.get_weights())
    clean_x, clean_y = _regression_data()
    weights = []
    for check_finite in (True, False):
        with kt.distributed("mirrored", devices=TWO):
            model = _regression_model(keras.optimizers.SGD(0.01))
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", check_finite=check_finite)
            model.fit(clean_x, clean_y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(kt.errors.ArgumentError, match="check_finite must be True or False; got 'no'"):
        model.compile(optimizer="sgd", loss="mse", check_finite="no")


def test_a_nan_in_a_trainer_tower_function_stops_it():
    x, y = _regression_data(nan_at=5)

    class Regression(kt.Trainer):
        @kt.Trainer.tower_function
        def step(self, batch):
            features, targets = batch
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((self.model(features) - targets) ** 2)
            variables = self.model.trainable_variables
            self.model.optimizer.apply(tape.gradient(loss, variables), variables)
            return {"loss": loss}

        def run_step(self):
            return self.step(self.next_batches())

    with kt.distributed("mirrored", devices=TWO):
        model = _regression_model(keras.optimizers.SGD(0.01))
        trainer = Regression(model, kt.DatasetInput(tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()))
        with pytest.raises(NonFiniteError, match="step 1 .*on tower 1 of 2"):
            trainer.train(steps_per_epoch=4, max_epoch=1, verbose=0)
    assert all(np.isfinite(w).all() for w in model.get_weights())


# -- item 5: exact resume when an epoch is one pass ----------------------------------

def _one_pass_run(ckpt_dir, source_kind, stop_at=None, resume=True):
    keras.utils.set_random_seed(11)
    x, y = id_data(40)
    x[:, 0] /= 40.0
    with kt.distributed("mirrored", devices=TWO):
        inputs = keras.Input((4,))
        hidden = keras.layers.Dropout(0.2)(keras.layers.Dense(8, activation="relu")(inputs))
        model = kt.TowerModel(inputs, keras.layers.Dense(3)(hidden))
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        if source_kind == "arrays":
            data = dict(x=x, y=y, batch_size=4, shuffle=True)
        else:  # a pipeline that reshuffles every pass
            dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(40, seed=5).batch(4)
            data = dict(x=dataset)
        callbacks = [kt.callbacks.PeriodicTrigger(kt.callbacks.ModelSaver(ckpt_dir), every_k_steps=1)]
        if resume:
            callbacks.insert(0, kt.callbacks.AutoResume(ckpt_dir))
        if stop_at is not None:
            callbacks.append(StopAt(stop_at))
        model.fit(**data, epochs=3, verbose=0, callbacks=callbacks)
    return model


@pytest.mark.parametrize("source_kind", ["arrays", "reshuffling_dataset"])
def test_resume_without_steps_per_epoch_is_bit_equal(tmp_path, source_kind):
    uninterrupted = _one_pass_run(str(tmp_path / "a"), source_kind)
    with pytest.raises(Stop):
        _one_pass_run(str(tmp_path / "b"), source_kind, stop_at=13)  # epoch 3 of 5-step passes, step 3
    resumed = _one_pass_run(str(tmp_path / "b"), source_kind)
    assert resumed.loop.global_step == uninterrupted.loop.global_step == 15
    for a, b in zip(uninterrupted.get_weights(), resumed.get_weights()):
        np.testing.assert_array_equal(a, b)


# -- item 7: input errors ------------------------------------------------------------

def test_an_endless_input_without_steps_per_epoch_is_refused_at_once(two_towers):
    x, y = id_data(16)
    model = _regression_model("sgd")
    dataset = tf.data.Dataset.from_tensor_slices((x, y.astype("float32")[:, None])).batch(4).repeat()
    with pytest.raises(kt.errors.InputSourceError, match="never ends.*steps_per_epoch"):
        model.fit(dataset, epochs=1, verbose=0)
    assert model.loop.global_step == 0


def test_a_generator_exception_reaches_the_user_chained():
    x, y = _regression_data()

    class BadRecord(Exception):
        """The user's own error type, which must reach them."""

    def batches():
        for start in range(0, 64, 4):
            if start == 20:
                raise BadRecord("record 20 is corrupt")
            yield x[start:start + 4], y[start:start + 4]

    source = kt.GeneratorInput(batches, (tf.TensorSpec((None, 4)), tf.TensorSpec((None, 1))))
    with kt.distributed("mirrored", devices=TWO):
        model = _regression_model("sgd")
        # Batch 6 (examples 20..23) is tower 1's batch of step 3.
        with pytest.raises(StepFailedError, match=r"Training step 3 failed on tower 1: .*BadRecord: record 20") as caught:
            model.fit(source, epochs=1, verbose=0)
    assert isinstance(caught.value.__cause__, BadRecord)


def test_a_label_out_of_range_names_the_step_and_the_tower(two_towers):
    x, y = id_data(32)
    y[:] = 0
    y[13] = 7  # step 2 (8 examples a step), tower 1
    inputs = keras.Input((4,))
    model = kt.TowerModel(inputs, keras.layers.Dense(3)(inputs))
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.raises(StepFailedError, match=r"Training step 2 failed on tower 1: .*label value of 7") as caught:
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert isinstance(caught.value.__cause__, tf.errors.InvalidArgumentError)


@pytest.mark.parametrize("method", ["evaluate", "predict"])
def test_evaluate_and_predict_on_an_empty_input_raise(two_towers, method):
    model = _regression_model("sgd")
    empty = tf.data.Dataset.from_tensor_slices(
        (np.zeros((0, 4), "float32"), np.zeros((0, 1), "float32"))).batch(4)
    with pytest.raises(kt.errors.InputSourceError, match=f"{method}\\(\\) got no batch"):
        getattr(model, method)(empty, verbose=0)


def test_a_checkpoint_that_cannot_be_written_stops_training_saying_what_is_kept(two_towers, tmp_path):
    ckpt_dir, moved = str(tmp_path / "ckpt"), str(tmp_path / "moved")

    class FolderTurnsIntoAFile(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if self.model.loop.global_step == 2:
                os.rename(ckpt_dir, moved)
                with open(ckpt_dir, "w") as f:
                    f.write("not a folder")

    x, y = _regression_data()
    model = _regression_model("sgd")
    saver = kt.callbacks.PeriodicTrigger(kt.callbacks.ModelSaver(ckpt_dir), every_k_steps=1)
    with pytest.raises(kt.KerasTowerError, match="could not write the checkpoint of global step 3") as caught:
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[saver, FolderTurnsIntoAFile()])
    assert isinstance(caught.value.__cause__, OSError)
    assert [step for step, _ in kt.checkpoint.list_checkpoints(moved)] == [1, 2]
    for _, path in kt.checkpoint.list_checkpoints(moved):
        kt.checkpoint.verify_checkpoint(path)
