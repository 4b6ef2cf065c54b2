"""mixed_float16 with a LossScaleOptimizer on N towers against stock Keras (issue 54).

Under `mixed_float16` Keras's compile wraps the optimizer in a
`keras.optimizers.LossScaleOptimizer`. While its loss scale is too high
the scaled gradients overflow float16; the optimizer then skips the step
and halves the scale (after `dynamic_growth_steps` finite steps it doubles
it again). kerastower's NaN guard must leave that to it, on both backends:
on JAX it used to stop at step 1 with `NonFiniteError`.

The data's large targets make the first steps overflow at Keras's initial
scale (2**15), so the comparison covers skipped and applied steps: stock
`keras.Model` on one device, `kt.TowerModel` on 1 tower (equal to it) and
on 2 towers with half the batch each (equal to one device on the joined
batch). The loss scale, the count of applied steps, the weights and the
logged loss are compared.

Tolerance on 2 towers: each tower's float16 backward pass rounds its
gradients (relative unit roundoff 2**-11) where one device rounds the
joined batch's, so an applied update may differ by a few units of float16
rounding of itself. The weights must agree within 2**-8 of how far
training moved them (the updates' size), and the loss scale and the
number of applied steps exactly: whether a step overflowed must be
decided alike. The logged loss is computed from float16 predictions, each
rounded within 2**-11 of itself: a weight a rounding apart may move one
by that much, the squared error by twice as much relative to the error
(the predictions are smaller than the errors here), so 2**-10 relative.
One tower must equal stock Keras within float32 noise (1e-6).
"""

import contextlib

import keras
import numpy as np
import pytest

from tests.helpers.common import tower_devices

import kerastower as kt

BATCH = 16  # one device's batch: 2 towers get 8 examples each
EPOCHS = 3


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * BATCH, 4)).astype("float32")
    # Targets around 30: the float16 backward signal of the squared error
    # overflows at a loss scale of 2**15 (and until 2**10).
    y = (30.0 + 3.0 * x[:, :1] - 2.0 * x[:, 1:2]).astype("float32")
    return x, y


def _optimizer(kind):
    if kind == "keras_wraps":
        return keras.optimizers.SGD(0.002)  # compile wraps it (initial scale 2**15)
    # Overflows from 2**20 down, then grows back after every 2 finite steps
    # and overflows again: skipping, lowering and raising all act.
    return keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.002), initial_scale=2.0**20, dynamic_growth_steps=2)


def _fit(model_class, kind, num_towers=None):
    """(weights before, weights after, loss scale, applied steps, logged losses)."""
    strategy = (kt.distributed("mirrored", devices=tower_devices(num_towers)) if num_towers
                else contextlib.nullcontext())
    x, y = _data()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy:
            keras.utils.set_random_seed(0)
            inputs = keras.Input((4,))
            hidden = keras.layers.Dense(8, activation="tanh")(inputs)
            model = model_class(inputs, keras.layers.Dense(1)(hidden))
            model.compile(optimizer=_optimizer(kind), loss="mse")
            assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
            before = [np.array(w) for w in model.get_weights()]
            history = model.fit(x, y, batch_size=BATCH // (num_towers or 1), epochs=EPOCHS,
                                shuffle=False, verbose=0)
            optimizer = model.optimizer
            return (before, model.get_weights(),
                    float(keras.ops.convert_to_numpy(optimizer.dynamic_scale)),
                    int(keras.ops.convert_to_numpy(optimizer.inner_optimizer.iterations)),
                    history.history["loss"])
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("kind", ["keras_wraps", "explicit"])
def test_loss_scale_overflow_on_towers_equals_stock_keras(kind):
    before, stock, stock_scale, stock_applied, stock_loss = _fit(keras.Model, kind)
    steps = EPOCHS * len(_data()[0]) // BATCH
    # The comparison means something: stock Keras skipped steps, lowered
    # its scale, and still trained.
    assert stock_scale < (2.0**15 if kind == "keras_wraps" else 2.0**20)
    assert 0 < stock_applied < steps
    moved = max(float(np.abs(a - b).max()) for a, b in zip(stock, before))
    assert moved > 1e-3

    for towers in (1, 2):
        _, weights, scale, applied, loss = _fit(kt.TowerModel, kind, towers)
        what = f"{kind}, {towers} tower(s)"
        assert (scale, applied) == (stock_scale, stock_applied), what
        atol = 1e-6 if towers == 1 else moved * 2.0**-8
        for got, want in zip(weights, stock):
            np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=what)
        np.testing.assert_allclose(loss, stock_loss, rtol=1e-6 if towers == 1 else 2.0**-10,
                                   err_msg=what)
