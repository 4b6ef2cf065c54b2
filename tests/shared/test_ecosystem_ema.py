"""EMA weights on 1 tower give stock Keras's numbers to the bit.

`SGD(use_ema=True)` with `SwapEMAWeights(swap_on_epoch=True)` and
`ModelCheckpoint`, as Keras's own
swap_ema_weights tests run them: the weights and the moving averages equal
stock's exactly, and the model saved at the last epoch evaluates exactly as
the trained one (Keras's own test's assertion, which failed: the saved
TowerModel compiled its step without XLA, a TowerModel now saves the
`jit_compile` it was given). The logged losses are compared within 1e-6:
stock Keras's own differ by one rounding from run to run of the same
program on this CPU (its threaded sums), measured on both backends.
"""

import os

import keras
import numpy as np

import kerastower as kt



def _data():
    rng = np.random.default_rng(2023)
    x = rng.normal(size=(10, 3)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 2, 10), 2).astype("float32")
    return x, y


def _run(tower, swap_on_epoch, folder):
    x, y = _data()
    model = keras.Sequential([keras.Input((3,)),
                              keras.layers.Dense(2, kernel_initializer="ones", use_bias=False)])
    if tower:  # outside every kt.distributed block: one tower on the default device
        model = kt.TowerModel(model)
    model.compile(optimizer=keras.optimizers.SGD(use_ema=True, ema_momentum=0.9), loss="mse",
                  metrics=[keras.metrics.MeanSquaredError()], jit_compile=True)
    history = model.fit(x, y, epochs=2, verbose=0, validation_data=(x, y), callbacks=[
        keras.callbacks.SwapEMAWeights(swap_on_epoch=swap_on_epoch),
        keras.callbacks.ModelCheckpoint(os.path.join(folder, "{epoch:1d}.keras"))])
    saved = keras.models.load_model(os.path.join(folder, "2.keras"))
    return {
        "history": history.history,
        "weights": [np.array(w) for w in model.get_weights()],
        "averages": [np.array(v) for v in model.optimizer._model_variables_moving_average],
        "evaluated": model.evaluate(x, y, verbose=0, return_dict=True),
        "saved_evaluated": saved.evaluate(x, y, verbose=0, return_dict=True),
        "saved_jit_compile": saved.get_compile_config()["jit_compile"],
    }


def test_ema_on_one_tower_equals_stock_to_the_bit(tmp_path):
    stock = _run(False, True, str(tmp_path / "stock"))
    tower = _run(True, True, str(tmp_path / "tower"))
    for key in ("weights", "averages"):
        for got, want in zip(tower[key], stock[key]):
            np.testing.assert_array_equal(got, want, err_msg=key)
    assert sorted(tower["history"]) == sorted(stock["history"])
    for key, values in stock["history"].items():
        np.testing.assert_allclose(tower["history"][key], values, rtol=1e-6, err_msg=key)
    for key, value in stock["evaluated"].items():
        np.testing.assert_allclose(tower["evaluated"][key], value, rtol=1e-6, err_msg=key)
    assert tower["saved_jit_compile"] is True
    # The checkpoint holds the EMA weights the model ends with.
    assert tower["saved_evaluated"] == tower["evaluated"]
