"""Ragged and sparse tensors as `x`, as stock Keras takes them (issue 53, must-have 4).

What stock Keras 3.15.1 does with them, per backend (its data adapters):

- TensorFlow: a `tf.RaggedTensor` or `tf.SparseTensor` (and a scipy sparse
  matrix, made a `tf.SparseTensor`) reaches the model as it is, given as
  arrays, inside a `tf.data.Dataset` or (sparse) from a generator; predict
  joins ragged outputs with `tf.concat` and sparse ones with
  `tf.sparse.concat`, and dense outputs whose shapes differ from batch to
  batch into a `tf.RaggedTensor`.
- JAX: a batch's `tf.RaggedTensor` is made dense (`to_tensor()`: padded with
  zeros to the batch's longest row); a `tf.SparseTensor`, scipy matrix or
  `jax.experimental.sparse.BCOO`, from arrays, a `tf.data.Dataset` or a
  generator, reaches the model as a BCOO. predict joins the batches'
  outputs with `np.concatenate`, which fails where they differ in width and
  makes an array of BCOO objects of a sparse output: kerastower refuses
  both, with its own error.

kerastower must do the same: one tower gives stock Keras's numbers, and two
towers those of one device on the two towers' batches joined. The last
tests are Keras's own `test_trainer_with_raggeds` (its model, layer and
functional variants) on a TowerModel.
"""

import functools

import keras
import numpy as np
import pytest

from tests.helpers.common import BACKEND
from tests.helpers.common import tower_devices

import kerastower as kt

tf = pytest.importorskip("tensorflow")

B = 4  # per-tower batch
ON_JAX = BACKEND == "jax"
# One tower runs stock Keras's arithmetic (measured: the same bits); two
# towers sum their halves apart (measured: within 3e-7 of one device).
ATOL = 1e-6


def _ragged_data(n=18, seed=0):
    """n rows of 1 to 5 numbers (a tf.RaggedTensor) and a target each."""
    rng = np.random.default_rng(seed)
    rows = [rng.normal(size=int(k)).astype("float32") for k in rng.integers(1, 6, n)]
    x = tf.ragged.constant(rows, dtype=tf.float32, ragged_rank=1)
    y = np.array([[row.sum() * 0.5 + 0.1] for row in rows], "float32")
    return x, y


def _sparse_data(kind, n=18, features=6, seed=1):
    """(x as `kind` of sparse matrix, x dense, y): about a third of x set."""
    rng = np.random.default_rng(seed)
    dense = (rng.normal(size=(n, features)) * (rng.random((n, features)) < 0.35)).astype("float32")
    y = dense @ rng.normal(size=(features, 1)).astype("float32")
    if kind == "tf":
        x = tf.sparse.from_dense(dense)
    elif kind == "scipy":
        scipy_sparse = pytest.importorskip("scipy.sparse")
        x = scipy_sparse.csr_matrix(dense)
    else:
        from jax.experimental import sparse as jax_sparse

        x = jax_sparse.BCOO.fromdense(dense)
    return x, dense, y


class RowSum(keras.layers.Layer):
    """Each row's sum: what padding with zeros leaves unchanged, so that it
    means the same on a ragged row (TensorFlow) and a padded one (JAX)."""

    def call(self, x):
        return keras.ops.sum(x, axis=1, keepdims=True)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], 1)


def _ragged_model(base, steps_per_execution=1):
    keras.utils.set_random_seed(11)
    # Only TensorFlow has ragged inputs; on JAX the rows arrive padded.
    inputs = keras.Input((None,), ragged=not ON_JAX)
    hidden = keras.layers.Dense(4, activation="tanh")(RowSum()(inputs))
    model = base(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"],
                  steps_per_execution=steps_per_execution)
    return model


def _sparse_model(base, steps_per_execution=1):
    keras.utils.set_random_seed(12)
    inputs = keras.Input((6,), sparse=True)
    hidden = keras.layers.Dense(4, activation="tanh")(inputs)
    model = base(inputs, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"],
                  steps_per_execution=steps_per_execution)
    return model


def _run(build, towers, x, y=None, batch_size=None, epochs=2):
    """(weights, fit's history, evaluate's logs, predictions) of `build`'s
    model trained on x, y: stock keras.Model with `towers=None`, else a
    TowerModel on `towers` towers. x may be a tf.data.Dataset."""
    def run(model):
        kwargs = {} if batch_size is None else {"batch_size": batch_size}
        history = model.fit(x, y, epochs=epochs, verbose=0, **kwargs)
        logs = model.evaluate(x, y, verbose=0, return_dict=True, **kwargs)
        predictions = model.predict(x, verbose=0, **kwargs)
        return model.get_weights(), history.history, logs, predictions

    if towers is None:
        return run(build(keras.Model))
    with kt.distributed("mirrored", devices=tower_devices(towers)):
        return run(build(kt.TowerModel))


def _assert_same(got, want, atol):
    got_weights, got_history, got_logs, got_predictions = got
    want_weights, want_history, want_logs, want_predictions = want
    assert len(got_weights) == len(want_weights)
    for g, w in zip(got_weights, want_weights):
        np.testing.assert_allclose(g, w, rtol=atol, atol=atol)
    assert sorted(got_history) == sorted(want_history)
    for key in want_history:
        np.testing.assert_allclose(got_history[key], want_history[key], rtol=atol, atol=atol, err_msg=key)
    assert sorted(got_logs) == sorted(want_logs)
    for key in want_logs:
        np.testing.assert_allclose(got_logs[key], want_logs[key], rtol=atol, atol=atol, err_msg=key)
    assert type(got_predictions) is type(want_predictions)
    np.testing.assert_allclose(got_predictions, want_predictions, rtol=atol, atol=atol)




@pytest.mark.parametrize("towers", [1, 2])
def test_ragged_arrays_train_as_stock_keras(towers):
    x, y = _ragged_data()
    want = _run(_ragged_model, None, x, y, batch_size=B * towers)
    got = _run(_ragged_model, towers, x, y, batch_size=B)
    _assert_same(got, want, ATOL)


@pytest.mark.parametrize("towers", [1, 2])
def test_ragged_dataset_trains_as_stock_keras(towers):
    x, y = _ragged_data()

    def batches(size):
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(size)

    # Two steps a call: on JAX, steps whose padded widths differ run apart.
    build = functools.partial(_ragged_model, steps_per_execution=2)
    want = _run(build, None, batches(B * towers))
    got = _run(build, towers, batches(B))
    _assert_same(got, want, ATOL)


def _sparse_kinds():
    return ["tf", "scipy"] + (["bcoo"] if ON_JAX else [])


def _sparse_cases():
    """(towers, kind): every kind on 2 towers, TensorFlow's on 1 too (the
    kinds are converted alike whatever the number of towers)."""
    return [(1, "tf")] + [(2, kind) for kind in _sparse_kinds()]


@pytest.mark.parametrize("towers,kind", _sparse_cases())
def test_sparse_arrays_train_as_stock_keras(kind, towers):
    x, _, y = _sparse_data(kind)
    want = _run(_sparse_model, None, x, y, batch_size=B * towers)
    got = _run(_sparse_model, towers, x, y, batch_size=B)
    _assert_same(got, want, ATOL)


@pytest.mark.parametrize("towers", [1, 2])
def test_sparse_dataset_trains_as_stock_keras(towers):
    x, _, y = _sparse_data("tf")

    def batches(size):
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(size)

    # Two steps a call: on JAX, steps whose rows hold more entries run apart.
    build = functools.partial(_sparse_model, steps_per_execution=2)
    want = _run(build, None, batches(B * towers))
    got = _run(build, towers, batches(B))
    _assert_same(got, want, ATOL)


def _sparse_batches(x, y, size):
    """x and y's batches of `size` rows, x as sparse as it came."""
    for start in range(0, len(y), size):
        if isinstance(x, tf.SparseTensor):
            part = tf.sparse.slice(x, [start, 0], [size, x.dense_shape[1]])
        else:
            part = x[start:start + size]
        yield part, y[start:start + size]


def _run_on_batches(build, towers, x, y, size):
    """As `_run`, on fresh generators of sparse batches of `size` rows."""
    def run(model):
        history = model.fit(_sparse_batches(x, y, size), verbose=0)
        logs = model.evaluate(_sparse_batches(x, y, size), verbose=0, return_dict=True)
        predictions = model.predict(_sparse_batches(x, y, size), verbose=0)
        return model.get_weights(), history.history, logs, predictions

    if towers is None:
        return run(build(keras.Model))
    with kt.distributed("mirrored", devices=tower_devices(towers)):
        return run(build(kt.TowerModel))


@pytest.mark.parametrize("towers,kind", _sparse_cases())
def test_sparse_batches_of_a_generator(kind, towers):
    x, _, y = _sparse_data(kind)
    want = _run_on_batches(_sparse_model, None, x, y, B * towers)
    if not ON_JAX:
        # Stock Keras reads them (tf.data's from_generator); kerastower's
        # TensorFlow feed of Python batches takes dense arrays only, and
        # says what to pass instead.
        with pytest.raises(kt.InputSourceError, match="tf.data.Dataset"):
            _run_on_batches(_sparse_model, towers, x, y, B)
        return
    got = _run_on_batches(_sparse_model, towers, x, y, B)
    _assert_same(got, want, ATOL)


def _doubled_sparse(base, x, batch_size):
    inputs = keras.Input((6,), sparse=True)
    model = base(inputs, inputs * 2.0)
    return model.predict(x, batch_size=batch_size, verbose=0)


@pytest.mark.skipif(ON_JAX, reason="Keras-JAX cannot join sparse outputs (the test below)")
@pytest.mark.parametrize("towers", [1, 2])
def test_sparse_outputs_are_joined_as_keras_joins_them(towers):
    x, dense, _ = _sparse_data("tf")
    want = _doubled_sparse(keras.Model, x, B * towers)
    with kt.distributed("mirrored", devices=tower_devices(towers)):
        got = _doubled_sparse(kt.TowerModel, x, B)
    # Keras's TensorFlow predict joins sparse batches with tf.sparse.concat.
    assert isinstance(got, tf.SparseTensor) and isinstance(want, tf.SparseTensor)
    np.testing.assert_array_equal(tf.sparse.to_dense(got).numpy(), tf.sparse.to_dense(want).numpy())
    np.testing.assert_array_equal(tf.sparse.to_dense(got).numpy(), dense * 2)


@pytest.mark.skipif(not ON_JAX, reason="TensorFlow joins sparse outputs (the test above)")
def test_jax_sparse_outputs_are_refused_where_keras_cannot_join_them():
    x, dense, _ = _sparse_data("tf")
    # Stock Keras-JAX's np.concatenate takes a BCOO for a sequence of rows:
    # its predictions are an array of BCOO objects.
    assert _doubled_sparse(keras.Model, x, B).dtype == object
    with kt.distributed("mirrored", devices=tower_devices(1)):
        with pytest.raises(kt.KerasTowerError, match="sparse"):
            _doubled_sparse(kt.TowerModel, x, B)
    # Several towers take their sparse batches dense (JAX's sparse
    # operations cannot be differentiated in a shard_map tower): the model's
    # outputs are dense then.
    with kt.distributed("mirrored", devices=tower_devices(2)):
        np.testing.assert_array_equal(_doubled_sparse(kt.TowerModel, x, B), dense * 2)


def _doubled_ragged(base, x, batch_size):
    inputs = keras.Input((None,), ragged=not ON_JAX)
    model = base(inputs, keras.layers.Lambda(lambda t: t * 2.0)(inputs))
    return model.predict(x, batch_size=batch_size, verbose=0)


@pytest.mark.parametrize("towers", [1, 2])
def test_ragged_outputs_are_joined_as_keras_joins_them(towers):
    x, _ = _ragged_data(n=9)
    if ON_JAX:
        # Padded per batch, the batches' outputs differ in width: stock
        # Keras's np.concatenate fails, so one batch holds them all here.
        batch_size = 9
    else:
        batch_size = 2
    want = _doubled_ragged(keras.Model, x, batch_size * towers)
    with kt.distributed("mirrored", devices=tower_devices(towers)):
        got = _doubled_ragged(kt.TowerModel, x, batch_size)
    assert type(got) is type(want)
    if ON_JAX:
        np.testing.assert_array_equal(got, want)
    else:
        assert isinstance(got, tf.RaggedTensor)
        assert got.to_list() == want.to_list() == (x * 2.0).to_list()


@pytest.mark.skipif(not ON_JAX, reason="TensorFlow joins ragged outputs into a tf.RaggedTensor")
def test_jax_predictions_of_different_widths_are_refused_as_in_keras():
    x, _ = _ragged_data(n=9)
    with pytest.raises(ValueError):   # stock Keras: numpy cannot join them
        _doubled_ragged(keras.Model, x, 2)
    with kt.distributed("mirrored", devices=tower_devices(1)):
        with pytest.raises(kt.DataMismatchError, match="pad"):
            _doubled_ragged(kt.TowerModel, x, 2)


@pytest.mark.skipif(not ON_JAX, reason="on TensorFlow the towers' ragged rows stay ragged")
def test_jax_towers_of_one_step_pad_their_rows_as_the_joined_batch():
    """Each tower pads its batch's rows to the longest of the step's
    batches: the joined batch, as one device pads it."""
    x, _ = _ragged_data(n=8)
    want = _doubled_ragged(keras.Model, x, 8)
    with kt.distributed("mirrored", devices=tower_devices(2)):
        got = _doubled_ragged(kt.TowerModel, x, 4)
    np.testing.assert_array_equal(got, want)


# Keras's own test_trainer_with_raggeds (keras/src/trainers/trainer_test.py),
# on TowerModels: a model doubling its input, made three ways, trained on a
# ragged x (its own target, under a loss of 0) and predicting a ragged x.


def _zero_loss(y_true, y_pred, sample_weight=None):
    return 0.0


class Doubling(keras.layers.Layer):
    def call(self, x):
        return x * 2


class DoublingTowerModel(kt.TowerModel):
    def call(self, x):
        return x * 2


class DoublingKerasModel(keras.Model):
    def call(self, x):
        return x * 2


def _keras_ragged_test(variant, batch_size):
    """What Keras's test checks, on the current strategy's towers: the
    model's own call (TensorFlow only: Keras's JAX models take no ragged
    tensor), fit and predict, then the same through a Sequential; returns
    the predictions."""
    x = tf.ragged.constant([[1], [2, 3]])
    predictions = []
    if variant in ("model", "functional"):
        model = DoublingTowerModel() if variant == "model" else kt.TowerModel(*_doubling_graph())
        if not ON_JAX:
            assert isinstance(model(x), tf.RaggedTensor)
        model.compile(optimizer="adam", loss=_zero_loss)
        model.fit(x, x, batch_size=batch_size, verbose=0)
        predictions.append(model.predict(x, batch_size=batch_size, verbose=0))
    elif not ON_JAX:
        assert isinstance(Doubling()(x), tf.RaggedTensor)
    inner = {"model": DoublingKerasModel, "layer": Doubling,
             "functional": lambda: keras.Model(*_doubling_graph())}[variant]()
    model = kt.TowerModel(keras.Sequential([inner]))
    model.compile(optimizer="adam", loss=_zero_loss)
    model.fit(x, x, batch_size=batch_size, verbose=0)
    predictions.append(model.predict(x, batch_size=batch_size, verbose=0))
    return predictions


def _doubling_graph():
    inputs = keras.Input((None,))
    return inputs, Doubling()(inputs)


@pytest.mark.parametrize("variant", ["model", "layer", "functional"])
@pytest.mark.parametrize("towers", [1, 2])
def test_keras_trainer_with_raggeds(variant, towers):
    # One example a batch, so that two towers take one each in the step;
    # on one JAX tower both in one batch, as stock Keras-JAX cannot join
    # predictions of rows padded to different widths (tested above).
    batch_size = 1 if not ON_JAX or towers == 2 else 2
    with kt.distributed("mirrored", devices=tower_devices(towers)):
        predictions = _keras_ragged_test(variant, batch_size)
    assert predictions
    for predicted in predictions:
        if ON_JAX:
            # Keras-JAX pads the rows of a batch; two towers pad their
            # step's batches as the one batch they join.
            assert isinstance(predicted, np.ndarray)
            np.testing.assert_array_equal(predicted, [[2, 0], [4, 6]])
        else:
            assert isinstance(predicted, tf.RaggedTensor)
            assert predicted.to_list() == [[2], [4, 6]]
