"""keras.io's programs with only their base class changed (issue 31).

Each program of keras_io_programs.py runs three times from the same seed:
as written (`keras.Model`, stock Keras on one device), with
`kt.TowerModel` on one tower, and with `kt.TowerModel` on two towers at
half the batch. One tower must log what stock Keras logs (the same keys,
values within 1e-6) and end with the same weights; two towers must train,
and where the program draws no random numbers, equal one tower on the
joined batches within 1e-5.
"""

import keras
import numpy as np
import pytest

import kerastower as kt
from tests.helpers.common import assert_logs_equal
from tests.tensorflow.helpers import TWO
from tests.tensorflow.keras_io_programs import PROGRAMS

BATCH = 8


def _run(program, base, strategy=None, devices=None, batch_size=BATCH):
    """(the Program, its history, its weights after and before fit, its
    evaluation or None)."""
    keras.utils.set_random_seed(0)

    def train():
        made = program(base)
        initial = [w.numpy() for w in made.model.weights]
        history = made.fit(made.model, batch_size)
        evaluated = made.evaluate(made.model, batch_size) if made.evaluate else None
        return made, history.history, [w.numpy() for w in made.model.weights], initial, evaluated

    if strategy is None:
        return train()
    with kt.distributed(strategy, devices=devices):
        return train()


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_keras_io_program_with_its_base_class_changed(name):
    program = PROGRAMS[name]
    stock, stock_logs, stock_weights, stock_initial, stock_eval = _run(program, keras.Model)
    tower, tower_logs, tower_weights, _, tower_eval = _run(program, kt.TowerModel, "single")
    assert isinstance(tower.model, kt.TowerModel) and not isinstance(stock.model, kt.TowerModel)

    # One tower is stock Keras: the same history, the same weights.
    assert_logs_equal(tower_logs, stock_logs, 1e-6, f"{name}, 1 tower against stock Keras")
    assert len(tower_weights) == len(stock_weights)
    for got, want in zip(tower_weights, stock_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    if stock_eval is not None:
        assert_logs_equal(tower_eval, stock_eval, 1e-6, f"{name}, evaluate")
    # It trained, so the comparisons above can fail.
    assert any(np.abs(w - w0).max() > 1e-4 for w, w0 in zip(stock_weights, stock_initial))

    # Two towers at half the batch: the same steps on the joined batches.
    two, two_logs, two_weights, two_initial, two_eval = _run(
        program, kt.TowerModel, "mirrored", TWO, BATCH // 2)
    assert sorted(two_logs) == sorted(stock_logs)
    assert all(np.isfinite(v).all() for v in two_logs.values()), two_logs
    assert any(np.abs(w - w0).max() > 1e-4 for w, w0 in zip(two_weights, two_initial))
    if stock.deterministic:
        assert_logs_equal(two_logs, tower_logs, 1e-5, f"{name}, 2 towers against 1")
        for got, want in zip(two_weights, tower_weights):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
        if two_eval is not None:
            assert_logs_equal(two_eval, tower_eval, 1e-5, f"{name}, evaluate on 2 towers")


@pytest.mark.parametrize("shuffle", [True, "batch"])
def test_seeded_shuffle_and_validation_split_give_stock_keras_numbers(shuffle):
    """With `keras.utils.set_random_seed`, `fit(x, y)` reads the arrays in
    stock Keras's order on one tower (shuffled, or within batches), splits
    off the same validation rows, and starts from the same weights; two
    towers at half the batch read the joined batches in that order."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1)) + 0.1 * rng.normal(size=(40, 1))).astype("float32")

    def run(base, devices=None, batch_size=8):
        keras.utils.set_random_seed(0)
        with kt.distributed("mirrored", devices=devices or TWO[:1]):
            inputs = keras.Input((5,))
            model = base(inputs, keras.layers.Dense(1)(keras.layers.Dense(4, activation="tanh")(inputs)))
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
            history = model.fit(x, y, batch_size=batch_size, epochs=3, shuffle=shuffle,
                                validation_split=0.25, verbose=0)
        return history.history, [w.numpy() for w in model.weights]

    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    stock = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(4, activation="tanh")(inputs)))
    stock.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    stock_logs = stock.fit(x, y, batch_size=8, epochs=3, shuffle=shuffle, validation_split=0.25,
                           verbose=0).history
    one_logs, one_weights = run(kt.TowerModel)
    assert_logs_equal(one_logs, stock_logs, 1e-6, f"shuffle={shuffle!r}, 1 tower against stock Keras")
    for got, want in zip(one_weights, stock.weights):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-6)
    two_logs, two_weights = run(kt.TowerModel, TWO, batch_size=4)
    assert_logs_equal(two_logs, one_logs, 1e-5, f"shuffle={shuffle!r}, 2 towers against 1")
    for got, want in zip(two_weights, one_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_optimizers_built_on_first_use_are_checkpointed_and_resumed(tmp_path):
    """The CycleGAN's four optimizers build on first use; a run stopped
    after one epoch and resumed from its checkpoint ends where an
    uninterrupted run does."""
    program = PROGRAMS["cyclegan"]

    def train(epochs, callbacks=()):
        keras.utils.set_random_seed(0)
        with kt.distributed("mirrored", devices=TWO):
            made = program(kt.TowerModel)
            history = made.fit(made.model, BATCH // 2, epochs=epochs, callbacks=list(callbacks))
        return made.model, history

    whole, _ = train(3)
    folder = str(tmp_path / "ckpt")
    first, _ = train(1, [kt.callbacks.ModelSaver(folder)])
    assert all(o.built for o in (first.gen_G_optimizer, first.disc_Y_optimizer))
    resumed, history = train(3, [kt.callbacks.ModelSaver(folder), kt.callbacks.AutoResume(folder)])
    assert len(history.history["G_loss"]) == 2   # epochs 2 and 3
    for optimizer in ("gen_G_optimizer", "gen_F_optimizer", "disc_X_optimizer", "disc_Y_optimizer"):
        got, want = getattr(resumed, optimizer), getattr(whole, optimizer)
        assert int(got.iterations.numpy()) == int(want.iterations.numpy()) == 12
        for a, b in zip(got.variables, want.variables):
            np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6, err_msg=a.path)
    for a, b in zip(resumed.weights, whole.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6, err_msg=a.path)


def test_a_model_without_call_and_an_unbuilt_part_says_which_layer():
    class Unbuilt(kt.TowerModel):
        def __init__(self):
            super().__init__()
            self.encoder = keras.layers.Dense(2, name="never_built")

        def train_step(self, data):
            return {}

    model = Unbuilt()
    model.compile(optimizer="adam")
    with pytest.raises(kt.TowerRuleError, match=r"no call\(\).*'never_built' \(Dense\).*layer.build"):
        model.fit(np.ones((8, 3), "float32"), batch_size=4, verbose=0)
