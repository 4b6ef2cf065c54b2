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
from tests.helpers.doctests import examples_of
from tests.helpers.doctests import run_examples


FEATURES = 64  # a batch of 2: the product's operands, 2x64 each, are smaller than the 64x64 kernel


def _kernel_only_model(check_finite=True, kernel=0.0):
    """x -> Dense(FEATURES, no bias): its one gradient is x^T dY."""
    with kt.distributed("single", devices=[0]):
        inputs = keras.Input((FEATURES,))
        outputs = keras.layers.Dense(FEATURES, use_bias=False,
                                     kernel_initializer=keras.initializers.Constant(kernel))(inputs)
        model = kt.TowerModel(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse", check_finite=check_finite)
    return model


def test_a_product_that_overflows_from_finite_operands_stops_training():
    # Activations 1e20 and a backward signal of 1e20 (mse of outputs
    # 64e20 against 0, over 2x64 values), both finite; their product, the
    # kernel's gradient, is 2e40: Inf in float32.
    x = np.full((2, FEATURES), 1e20, "float32")
    y = np.zeros((2, FEATURES), "float32")
    model = _kernel_only_model(kernel=1.0)
    with pytest.raises(kt.NonFiniteError) as caught:
        model.fit(x, y, batch_size=2, verbose=0)
    assert caught.value.global_step == 1
    np.testing.assert_array_equal(model.get_weights()[0], np.ones((FEATURES, FEATURES), "float32"))


def test_operands_past_the_bound_with_finite_gradients_apply_the_step():
    # sum|x| * sum|dY| = 1.28e37 * 2 exceeds the bound (float32 max / 16),
    # yet the gradient, x^T dY = -3.1e33 per weight, is finite: the step
    # must apply, exactly as with the check off.
    x = np.full((2, FEATURES), 1e35, "float32")
    y = np.ones((2, FEATURES), "float32")
    checked, unchecked = _kernel_only_model(), _kernel_only_model(check_finite=False)
    for model in (checked, unchecked):
        model.fit(x, y, batch_size=2, verbose=0)
    assert checked.loop.global_step == 1
    got, want = checked.get_weights()[0], unchecked.get_weights()[0]
    assert np.isfinite(got).all() and np.abs(got).min() > 1e28
    np.testing.assert_array_equal(got, want)


def _mlp(check_finite=True):
    with kt.distributed("single", devices=[0]):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((32,))
        hidden = keras.layers.Dense(FEATURES, activation="relu")(inputs)
        model = kt.TowerModel(inputs, keras.layers.Dense(3)(hidden))
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      check_finite=check_finite)
    return model


def test_an_inf_input_stops_at_its_step_with_the_weights_of_the_step_before():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 32)).astype("float32")
    y = rng.integers(0, 3, size=8)
    x_bad = x.copy()
    x_bad[5, 2] = np.inf  # step 3 of batch 2
    model = _mlp()
    start = model.get_weights()
    with pytest.raises(kt.NonFiniteError) as caught:
        model.fit(x_bad, y, batch_size=2, shuffle=False, verbose=0)
    assert caught.value.global_step == 3 and model.loop.global_step == 2
    reference = _mlp()
    reference.set_weights(start)
    reference.fit(x[:4], y[:4], batch_size=2, shuffle=False, verbose=0)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_finite_steps_train_exactly_as_with_the_check_off():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 32)).astype("float32")
    y = rng.integers(0, 3, size=16)
    checked, unchecked = _mlp(), _mlp(check_finite=False)
    histories = [model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0).history
                 for model in (checked, unchecked)]
    assert histories[0] == histories[1]
    for got, want in zip(checked.get_weights(), unchecked.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_a_gradient_whose_sum_overflows_from_finite_values_applies_the_step():
    # The bias's gradient is 1e37 for each of its 64 values (a loss of
    # 1e37 per output, x = 0): finite, but its sum, 6.4e38, is Inf in
    # float32. The quick flag (the sums) is then not sure, and the step's
    # other branch reads the values: the update must apply, as with the
    # check off.
    def loss(y_true, y_pred):
        return 1e37 * keras.ops.sum(y_pred, axis=-1)

    def model(check_finite):
        with kt.distributed("single", devices=[0]):
            inputs = keras.Input((FEATURES,))
            outputs = keras.layers.Dense(FEATURES, kernel_initializer="zeros")(inputs)
            model = kt.TowerModel(inputs, outputs)
            model.compile(optimizer=keras.optimizers.SGD(1e-36), loss=loss, check_finite=check_finite)
        return model

    x = np.zeros((2, FEATURES), "float32")
    y = np.zeros((2, FEATURES), "float32")
    checked, unchecked = model(True), model(False)
    for each in (checked, unchecked):
        each.fit(x, y, batch_size=2, verbose=0)
    assert checked.loop.global_step == 1
    got, want = checked.get_weights()[1], unchecked.get_weights()[1]
    np.testing.assert_allclose(got, np.full((FEATURES,), -10.0, "float32"), rtol=1e-6)
    np.testing.assert_array_equal(got, want)


def test_the_products_the_bound_covers_are_computed_inside_the_updates_cond():
    # Computed there, XLA may run one layer's product beside another's
    # update; computed before the cond, every product waits for all.
    import jax

    model = _mlp()
    rng = np.random.default_rng(3)
    model.fit(rng.normal(size=(4, 32)).astype("float32"), rng.integers(0, 3, size=4), batch_size=2, verbose=0)
    tower_steps = model.engine.tower_steps()
    tower_steps.flags_read_late = True  # the step that takes its state as its own
    assert not tower_steps.launches_ahead()
    function = tower_steps._function("train", tower_steps._train_body)
    state = (*tower_steps._current_state(), tower_steps._metric_state())
    data = (np.zeros((2, 32), "float32"), np.zeros((2,), "int32"))
    closed = jax.make_jaxpr(function)(state, data, tower_steps._gate(None))
    (call,) = closed.jaxpr.eqns
    step = call.params["jaxpr"].jaxpr

    def products(equations):
        # A kernel's product may come out transposed: shapes compared sorted.
        return [tuple(sorted(e.outvars[0].aval.shape)) for e in equations if e.primitive.name == "dot_general"]

    def in_branches(equations):
        found = []
        for e in equations:
            for branch in e.params.get("branches", ()):
                found += products(branch.jaxpr.eqns) + in_branches(branch.jaxpr.eqns)
        return found

    kernels = {(32, FEATURES), (3, FEATURES)}
    assert not kernels & set(products(step.eqns))
    assert kernels <= set(in_branches(step.eqns))


def test_a_product_read_elsewhere_too_is_computed_once():
    # A step that also logs its gradient's norm reads the product before
    # the update: it is computed there, once, and not again in the cond.
    import jax
    import jax.numpy as jnp

    from kerastower.backend.jax import finite_check

    def step(w, x):
        gradient = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
        return [gradient], jnp.sum(gradient * gradient)

    def checked_step(w, x):
        checked, norm = finite_check.checked_gradients(step, w, x)
        new, finite = checked.apply_if_finite(lambda gradients: w - 0.1 * gradients[0], lambda: w,
                                              jnp.asarray(True))
        return new, finite, norm

    def kernel_products(equations):
        found = 0
        for e in equations:
            found += e.primitive.name == "dot_general" and e.outvars[0].aval.shape == (FEATURES, FEATURES)
            for branch in e.params.get("branches", ()):
                found += kernel_products(branch.jaxpr.eqns)
        return found

    w, x = jnp.ones((FEATURES, FEATURES)), jnp.ones((2, FEATURES))
    closed = jax.make_jaxpr(checked_step)(w, x)
    assert kernel_products(closed.jaxpr.eqns) == 1
    new, finite, norm = jax.jit(checked_step)(w, x)
    gradient, _ = step(w, x)
    np.testing.assert_allclose(new, w - 0.1 * gradient[0], rtol=1e-6)
    assert bool(finite)


class _FirstBiasWithoutGradient(kt.TowerModel):
    def train_step(self, state, data):
        import jax

        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, y = data

        def loss_of(trainable):
            y_pred, non_trainable_out = self.stateless_call(trainable, non_trainable, x, training=True)
            return keras.ops.mean((y_pred - y) ** 2), non_trainable_out

        (loss, non_trainable), gradients = jax.value_and_grad(loss_of, has_aux=True)(trainable)
        gradients = [None if i == 1 else g for i, g in enumerate(gradients)]
        trainable, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, gradients, trainable)
        return {"loss": loss}, (trainable, non_trainable, optimizer_variables, metrics_variables)


def test_a_variable_without_a_gradient_trains_as_with_the_check_off():
    def model(check_finite):
        with kt.distributed("single", devices=[0]):
            keras.utils.set_random_seed(0)
            inputs = keras.Input((32,))
            hidden = keras.layers.Dense(FEATURES, activation="relu")(inputs)
            model = _FirstBiasWithoutGradient(inputs, keras.layers.Dense(1)(hidden))
            model.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse", check_finite=check_finite)
        return model

    rng = np.random.default_rng(4)
    x = rng.normal(size=(16, 32)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    checked, unchecked = model(True), model(False)
    start = checked.get_weights()
    for each in (checked, unchecked):
        each.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    np.testing.assert_array_equal(checked.get_weights()[1], start[1])  # the bias without a gradient
    for got, want in zip(checked.get_weights(), unchecked.get_weights()):
        np.testing.assert_array_equal(got, want)


def _kernel_gradient_producer(batch, precision=None):
    import jax
    import jax.numpy as jnp

    from kerastower.backend.jax import finite_check

    def gradient(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.matmul(x, w, precision=precision))))(w)

    closed = jax.make_jaxpr(gradient)(jnp.ones((FEATURES, FEATURES)), jnp.ones((batch, FEATURES)))
    producers = {var: eqn for eqn in closed.jaxpr.eqns for var in eqn.outvars}
    return finite_check._product_operands(closed.jaxpr.outvars[0], producers)


def test_a_kernels_gradient_is_bounded_by_its_products_operands_where_they_are_smaller():
    # These models' kernels take the bound: a check that never did would
    # leave the cases above to the plain check.
    operands = _kernel_gradient_producer(batch=2)
    assert operands is not None
    assert sorted(tuple(var.aval.shape) for var in operands) == [(2, FEATURES), (2, FEATURES)]
    # Operands as large as the gradient (a long sequence's activations):
    # summing them would cost more than reading the gradient.
    assert _kernel_gradient_producer(batch=FEATURES) is None
    # A product taking float16 operands (a dot algorithm; GPU only) turns
    # an activation of 1e5 into Inf however small the bound says it is.
    assert _kernel_gradient_producer(batch=2, precision="highest") is not None
    assert _kernel_gradient_producer(batch=2, precision="F16_F16_F32") is None


def test_a_keras_models_fit_step_takes_the_bound_for_its_wide_kernel(monkeypatch):
    from kerastower.backend.jax import finite_check

    bounded = []
    original = finite_check._product_operands

    def recorded(var, producers):
        operands = original(var, producers)
        bounded.append(None if operands is None else tuple(var.aval.shape))
        return operands

    monkeypatch.setattr(finite_check, "_product_operands", recorded)
    model = _mlp()
    rng = np.random.default_rng(2)
    model.fit(rng.normal(size=(4, 32)).astype("float32"), rng.integers(0, 3, size=4), batch_size=2, verbose=0)
    # Both kernels (32x64 from operands 2x32 and 2x64; 64x3 from 2x64 and
    # 2x3); the biases, sums over the batch, are read directly.
    assert bounded == [(32, FEATURES), None, (FEATURES, 3), None]


def test_the_modules_example_runs(tmp_path):
    from kerastower.backend.jax import finite_check

    tests = examples_of(finite_check)
    assert tests
    failures = run_examples(tests, tmp_path)
    assert not failures, failures[-3000:]
