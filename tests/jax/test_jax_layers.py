"""BatchNormalization and Dropout under JAX towers.

Synchronized BatchNormalization normalizes by the statistics of every
tower's examples, so N towers train like one device on the joined batch;
unsynchronized, each tower uses its own batch and the moving statistics
follow tower 0 (as in tensorpack). Dropout draws a different mask on every
tower, and a run repeats bit for bit under keras.utils.set_random_seed.
"""

import jax
import keras
import numpy as np
import pytest

import kerastower as kt

B = 8
STEPS = 3
MOMENTUM = 0.9
SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.3),
    "adam": lambda: keras.optimizers.Adam(0.03),
}


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    # Features of different scales and offsets: the towers' batch statistics
    # differ from each other and from the joined batch's.
    x = (rng.normal(size=(n, 6)) * np.arange(1, 7) + np.arange(6)).astype("float32")
    return x, rng.integers(0, 3, n).astype("int32")


def _batchnorm_model(optimizer, towers, synchronized, initial=None):
    with kt.distributed("mirrored", devices=list(range(towers))):
        keras.utils.set_random_seed(7)
        inputs = keras.Input((6,))
        # No bias before BatchNormalization: its true gradient is 0, and Adam
        # would blow the float noise in it up to full-size steps.
        h = keras.layers.Dense(8, use_bias=False, name="pre")(inputs)
        h = keras.layers.BatchNormalization(momentum=MOMENTUM, synchronized=synchronized, name="bn")(h)
        outputs = keras.layers.Dense(3, name="out")(keras.layers.Activation("relu")(h))
        model = kt.TowerModel(inputs, outputs)
        model.compile(optimizer=optimizer, loss=SCCE, metrics=["accuracy"])
    if initial is not None:
        model.set_weights(initial)
    return model


# -- BatchNormalization -------------------------------------------------------------

@pytest.mark.parametrize("towers", [2, 4])
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_synchronized_batchnorm_towers_equal_one_device(optimizer_name, towers):
    x, y = _data(B * 4 * STEPS)
    one = _batchnorm_model(OPTIMIZERS[optimizer_name](), 1, True)
    initial = [np.array(w) for w in one.get_weights()]
    many = _batchnorm_model(OPTIMIZERS[optimizer_name](), towers, True, initial)
    one_logs = one.fit(x, y, batch_size=towers * B, epochs=2, shuffle=False, verbose=0).history
    many_logs = many.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0).history

    steps = 2 * len(x) // (towers * B)
    assert int(many.optimizer.iterations.numpy()) == int(one.optimizer.iterations.numpy()) == steps
    paths = [w.path for w in one.weights]
    assert "bn/moving_mean" in paths and "bn/moving_variance" in paths
    moved = dict(zip(paths, (float(np.abs(a - w).max()) for a, w in zip(one.get_weights(), initial))))
    assert moved["bn/moving_mean"] > 0.1 and moved["pre/kernel"] > 1e-2
    for a, b, path in zip(one.get_weights(), many.get_weights(), paths):
        np.testing.assert_allclose(b, a, atol=1e-5, err_msg=f"{optimizer_name}/{towers}: {path}")
    assert sorted(one_logs) == sorted(many_logs)
    for key in one_logs:
        np.testing.assert_allclose(many_logs[key], one_logs[key], atol=1e-5, err_msg=f"logged {key}")
    np.testing.assert_allclose(
        many.evaluate(x, y, batch_size=B, verbose=0), one.evaluate(x, y, batch_size=B, verbose=0), atol=1e-5)


@pytest.mark.parametrize("towers", [2, 4])
def test_unsynchronized_batchnorm_uses_each_towers_statistics_and_keeps_tower_0s(towers):
    x, y = _data(B * towers, seed=1)
    batches = [(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]) for i in range(towers)]
    many = _batchnorm_model(keras.optimizers.SGD(0.3), towers, False)
    initial = [np.array(w) for w in many.get_weights()]
    many.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert many.loop.global_step == 1

    # Each tower alone: one device, one SGD step on that tower's batch.
    alone = []
    for bx, by in batches:
        model = _batchnorm_model(keras.optimizers.SGD(0.3), 1, False, initial)
        model.fit(bx, by, batch_size=B, epochs=1, shuffle=False, verbose=0)
        alone.append({w.path: np.array(w) for w in model.weights})
    got = {w.path: np.array(w) for w in many.weights}

    # Moving statistics: tower 0's batch alone, nothing from the others.
    kernel = initial[[w.path for w in many.weights].index("pre/kernel")]
    features = batches[0][0] @ kernel
    mean, variance = features.mean(0), features.var(0)
    np.testing.assert_allclose(got["bn/moving_mean"], (1 - MOMENTUM) * mean, atol=1e-5)
    np.testing.assert_allclose(got["bn/moving_variance"], MOMENTUM + (1 - MOMENTUM) * variance, atol=1e-5)
    joined = x @ kernel
    assert np.abs(got["bn/moving_mean"] - (1 - MOMENTUM) * joined.mean(0)).max() > 1e-2
    for path in ("bn/moving_mean", "bn/moving_variance"):
        np.testing.assert_allclose(got[path], alone[0][path], atol=1e-6)
    # Trainable weights: SGD is linear in the gradient, so the mean of the
    # towers' gradients (each normalized by its own batch) is the mean of
    # the towers' one-device steps.
    for path in ("pre/kernel", "bn/gamma", "bn/beta", "out/kernel", "out/bias"):
        np.testing.assert_allclose(got[path], np.mean([a[path] for a in alone], axis=0), atol=1e-5,
                                   err_msg=path)


def test_synchronized_batchnorm_outside_towers_uses_its_own_batch():
    x, _ = _data(16, seed=2)
    keras.utils.set_random_seed(3)
    with kt.distributed("single"):   # where kerastower admits the layer on JAX
        synced = keras.layers.BatchNormalization(synchronized=True)
        plain = keras.layers.BatchNormalization()
        expected = np.asarray(plain(x, training=True))
        np.testing.assert_allclose(np.asarray(synced(x, training=True)), expected, atol=1e-6)
        np.testing.assert_allclose(np.asarray(synced.moving_mean), np.asarray(plain.moving_mean), atol=1e-6)
        assert synced.get_config()["synchronized"] is True
        again = keras.layers.BatchNormalization.from_config(synced.get_config())
        assert again.synchronized is True


def test_outside_every_kerastower_scope_synchronized_batchnorm_is_keras_own():
    """kerastower's patches are held only by its scopes: outside them Keras
    refuses the layer on JAX, and one built inside is refused training."""
    x, _ = _data(16, seed=2)
    with pytest.raises(ValueError, match="only supported with the TensorFlow backend"):
        keras.layers.BatchNormalization(synchronized=True)
    with kt.distributed("single"):
        synced = keras.layers.BatchNormalization(synchronized=True)
    with pytest.raises(NotImplementedError, match="synchronized=True is not supported with JAX"):
        synced(x, training=True)
    assert synced(x, training=False).shape == x.shape   # inference reads no batch moments


def test_a_missing_keras_hook_fails_loudly_naming_the_versions(monkeypatch):
    from keras.src.backend.jax import nn as jax_nn

    monkeypatch.delattr(jax_nn, "moments")
    with pytest.raises(kt.KerasTowerError, match=r"keras\.src\.backend\.jax\.nn\.moments") as error:
        with kt.distributed("single"):
            pass
    assert f"Keras {keras.__version__}" in str(error.value)
    assert f"JAX {jax.__version__}" in str(error.value)
    # Nothing was left patched: the constructor is Keras's own again.
    with pytest.raises(ValueError, match="only supported with the TensorFlow backend"):
        keras.layers.BatchNormalization(synchronized=True)


# -- Dropout --------------------------------------------------------------------------

def _dropout_model(towers, rate=0.5, seed=7, initial=None):
    with kt.distributed("mirrored", devices=list(range(towers))):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((6,))
        h = keras.layers.Dense(16, activation="tanh")(inputs)
        h = keras.layers.Dropout(rate, name="dropout")(h)
        model = kt.TowerModel(inputs, keras.layers.Dense(3)(h))
        model.compile(optimizer=keras.optimizers.SGD(0.3), loss=SCCE, metrics=["accuracy"])
    if initial is not None:
        model.set_weights(initial)
    return model


def _seed_state(model):
    return model.get_layer("dropout").seed_generator.state


def test_towers_fed_the_same_batch_draw_different_dropout_masks():
    x, y = _data(B, seed=3)
    two = _dropout_model(2)
    initial = [np.array(w) for w in two.get_weights()]
    seed = np.array(_seed_state(two))
    two.fit(np.concatenate([x, x]), np.concatenate([y, y]), batch_size=B, epochs=1, shuffle=False, verbose=0)

    # One device on that batch, with tower 0's seed and with tower 1's
    # (tower 0's moved by 1_000_003, as on TensorFlow).
    steps = []
    for moved in (0, 1_000_003):
        one = _dropout_model(1, initial=initial)
        _seed_state(one).assign(seed + np.array([moved, 0], seed.dtype))
        one.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
        steps.append([np.array(w) - w0 for w, w0 in zip(one.get_weights(), initial)])
    tower0, tower1 = steps
    assert max(np.abs(a - b).max() for a, b in zip(tower0, tower1)) > 1e-3, "the two seeds draw one mask"
    for got, w0, a, b in zip(two.get_weights(), initial, tower0, tower1):
        # SGD: the step is the mean of the towers' steps, so the towers' masks differ.
        np.testing.assert_allclose(got - w0, (a + b) / 2, atol=1e-6)
    # Tower 0's stream goes on: one draw this step.
    np.testing.assert_array_equal(np.array(_seed_state(two)), seed + np.array([0, 1], seed.dtype))


def _dropout_run(seed, initial):
    x, y = _data(B * 2 * STEPS, seed=4)
    model = _dropout_model(2, seed=seed, initial=initial)
    model.fit(x, y, batch_size=B, epochs=2, shuffle=True, verbose=0)
    return model.get_weights()


def test_a_dropout_run_repeats_bit_for_bit_under_one_seed():
    initial = _dropout_model(1).get_weights()
    first, second, other = _dropout_run(3, initial), _dropout_run(3, initial), _dropout_run(4, initial)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(b, a)
    assert max(np.abs(a - c).max() for a, c in zip(first, other)) > 1e-4


@pytest.mark.parametrize("towers", [2, 4])
def test_dropout_at_rate_0_towers_equal_one_device(towers):
    x, y = _data(B * 4 * STEPS, seed=5)
    one = _dropout_model(1, rate=0.0)
    initial = [np.array(w) for w in one.get_weights()]
    many = _dropout_model(towers, rate=0.0, initial=initial)
    one_logs = one.fit(x, y, batch_size=towers * B, epochs=2, shuffle=False, verbose=0).history
    many_logs = many.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0).history
    assert max(np.abs(a - w).max() for a, w in zip(one.get_weights(), initial)) > 1e-2
    for a, b in zip(one.get_weights(), many.get_weights()):
        np.testing.assert_allclose(b, a, atol=1e-5)
    for key in one_logs:
        np.testing.assert_allclose(many_logs[key], one_logs[key], atol=1e-5, err_msg=key)


@pytest.mark.parametrize("towers", [2, 4])
def test_dropout_in_inference_towers_equal_one_device(towers):
    x, y = _data(B * towers * 2 + B, seed=6)
    one = _dropout_model(1)
    many = _dropout_model(towers, initial=one.get_weights())
    np.testing.assert_allclose(many.predict(x, batch_size=B, verbose=0),
                               one.predict(x, batch_size=B, verbose=0), atol=1e-6)
    np.testing.assert_allclose(many.evaluate(x, y, batch_size=B, verbose=0),
                               one.evaluate(x, y, batch_size=B * towers, verbose=0), atol=1e-6)


def test_synchronized_batchnorm_under_keras_distribution_raises_instead_of_a_local_mean():
    """Inside kt.distributed, kerastower lets Keras build and call
    BatchNormalization(synchronized=True) on JAX; under Keras's own data
    parallelism it would compute each device's moments alone, silently: it
    raises instead."""
    x, _ = _data(16, seed=2)
    with kt.distributed("single"):
        synced = keras.layers.BatchNormalization(synchronized=True)
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()[:2]))
        try:
            with pytest.raises(kt.KerasTowerError, match="synchronized over kerastower's towers only"):
                synced(x, training=True)
        finally:
            keras.distribution.set_distribution(None)
        assert synced(x, training=True).shape == x.shape   # outside it, as before
