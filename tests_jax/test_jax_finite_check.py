"""JAX, one tower: the NaN/Inf check bounds a kernel's gradient from the
matrix product that made it (backend/jax/finite_check.py), and reads the
gradients themselves wherever that bound is not met, so its verdict is the
plain check's: a step stops where a gradient is not finite, and only there.

Each case is built so that a check reading only the products' operands, or
one taking an unmet bound for a NaN, would decide it wrongly.
"""

import keras
import numpy as np
import pytest

import kerastower as kt


def _kernel_only_model(check_finite=True, kernel=0.0):
    """x (3 features) -> Dense(1, no bias): its one gradient is x^T dY."""
    with kt.distributed("single", devices=[0]):
        inputs = keras.Input((3,))
        outputs = keras.layers.Dense(1, use_bias=False,
                                     kernel_initializer=keras.initializers.Constant(kernel))(inputs)
        model = kt.TowerModel(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse", check_finite=check_finite)
    return model


def test_a_product_that_overflows_from_finite_operands_stops_training():
    # Activations 1e20 and a backward signal of about 1e20, both finite;
    # their product, the kernel's gradient, is about 1e40: Inf in float32.
    x = np.full((4, 3), 1e20, "float32")
    y = np.zeros((4, 1), "float32")
    model = _kernel_only_model(kernel=1.0)
    with pytest.raises(kt.NonFiniteError) as caught:
        model.fit(x, y, batch_size=4, verbose=0)
    assert caught.value.global_step == 1
    np.testing.assert_array_equal(model.get_weights()[0], np.ones((3, 1), "float32"))


def test_operands_past_the_bound_with_finite_gradients_apply_the_step():
    # sum|x| * sum|dY| = 1.2e37 * 2 exceeds the bound (float32 max / 16),
    # yet the gradient, x^T dY = -2e36 per weight, is finite: the step must
    # apply, exactly as with the check off.
    x = np.full((4, 3), 1e36, "float32")
    y = np.ones((4, 1), "float32")
    checked, unchecked = _kernel_only_model(), _kernel_only_model(check_finite=False)
    for model in (checked, unchecked):
        model.fit(x, y, batch_size=4, verbose=0)
    assert checked.loop.global_step == 1
    got, want = checked.get_weights()[0], unchecked.get_weights()[0]
    assert np.isfinite(got).all() and np.abs(got).min() > 1e32
    np.testing.assert_array_equal(got, want)


def _mlp(check_finite=True):
    with kt.distributed("single", devices=[0]):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        model = kt.TowerModel(inputs, keras.layers.Dense(3)(hidden))
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      check_finite=check_finite)
    return model


def test_an_inf_input_stops_at_its_step_with_the_weights_of_the_step_before():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype("float32")
    y = rng.integers(0, 3, size=32)
    x_bad = x.copy()
    x_bad[19, 2] = np.inf  # step 3 of batch 8
    model = _mlp()
    start = model.get_weights()
    with pytest.raises(kt.NonFiniteError) as caught:
        model.fit(x_bad, y, batch_size=8, shuffle=False, verbose=0)
    assert caught.value.global_step == 3 and model.loop.global_step == 2
    reference = _mlp()
    reference.set_weights(start)
    reference.fit(x[:16], y[:16], batch_size=8, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_finite_steps_train_exactly_as_with_the_check_off():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.integers(0, 3, size=64)
    checked, unchecked = _mlp(), _mlp(check_finite=False)
    histories = [model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history
                 for model in (checked, unchecked)]
    assert histories[0] == histories[1]
    for got, want in zip(checked.get_weights(), unchecked.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_the_modules_example_runs():
    import doctest

    from kerastower.backend.jax import finite_check

    failures, tried = doctest.testmod(finite_check, optionflags=doctest.ELLIPSIS)
    assert tried and not failures
