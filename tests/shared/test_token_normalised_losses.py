"""Token-normalised losses on N towers against one device on the joined batch (issue 27).

Keras divides a masked loss by the tower's own count of unmasked tokens.
When towers get very unequal padding, the mean of the towers' losses is
not the joined batch's loss. kerastower divides each tower's sum by the
joined batch's count instead (`kerastower/loss_divisors.py`): Keras's
masked losses without user code, a loss of one's own through
`kt.loss_divisor`. Each case here failed before that (2 towers drifted
3e-3 from one device); weights, history and evaluate's logs must now
agree within 1e-5, with a tower that gets no batch in the last step too.
"""

import keras
import numpy as np
import pytest

from tests.helpers.common import tower_devices

import kerastower as kt

T, VOCAB, B = 6, 7, 4


def _sequences():
    """16 rows; batches of 4 alternate short (1-2 tokens) and full rows, so
    tower 0 of every step gets little text and tower 1 a lot."""
    rng = np.random.default_rng(0)
    rows = []
    for batch in range(4):
        lengths = rng.integers(1, 3, B) if batch % 2 == 0 else rng.integers(5, T + 1, B)
        for length in lengths:
            row = np.zeros(T + 1, "int32")
            row[:length + 1] = rng.integers(1, VOCAB, length + 1)
            rows.append(row)
    rows = np.stack(rows)
    x, y = rows[:, :-1].copy(), rows[:, 1:].copy()
    y[x == 0] = 0
    return x, y


class TiedOutput(keras.layers.Layer):
    """Logits from the input embedding's own matrix (a tied embedding)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding
        self.supports_masking = True  # the loss is masked by the input's padding

    def call(self, h):
        return keras.ops.matmul(h, keras.ops.transpose(self.embedding.embeddings))


class CountNormalised(kt.TowerModel):
    """A sequence loss of its own: the summed token losses divided by the
    count of real tokens, through `kt.loss_divisor`."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        mask = keras.ops.cast(keras.ops.not_equal(x, 0), "float32")
        tokens = keras.losses.sparse_categorical_crossentropy(y, y_pred, from_logits=True)
        return keras.ops.sum(tokens * mask) / kt.loss_divisor(keras.ops.sum(mask))


def _masked_lstm(towers, kind="masked_lstm", optimizer=lambda: keras.optimizers.Adam(0.01)):
    keras.utils.set_random_seed(3)
    with kt.distributed("mirrored", devices=tower_devices(towers)):
        inputs = keras.Input((T,), dtype="int32")
        embedding = keras.layers.Embedding(VOCAB, 5, mask_zero=True)
        h = keras.layers.LSTM(8 if kind != "tied_embedding" else 5, return_sequences=True)(embedding(inputs))
        if kind == "tied_embedding":
            outputs = TiedOutput(embedding)(h)
        else:
            outputs = keras.layers.Dense(VOCAB)(h)
        model = (CountNormalised if kind == "own_count" else kt.TowerModel)(inputs, outputs)
        model.compile(optimizer=optimizer(), metrics=["accuracy"],
                      loss=None if kind == "own_count"
                      else keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _towers_train_as_the_joined_batch(x, y, towers=2, kind="masked_lstm"):
    """N towers of B rows a step against one device on the joined N x B
    rows, from the same weights: history, weights and evaluate within 1e-5."""
    one = _masked_lstm(1, kind)
    start = one.get_weights()
    want = one.fit(x, y, batch_size=towers * B, epochs=2, shuffle=False, verbose=0).history
    want_evaluated = one.evaluate(x, y, batch_size=towers * B, return_dict=True, verbose=0)
    many = _masked_lstm(towers, kind)
    many.set_weights(start)
    got = many.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0).history
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for a, b, w in zip(many.get_weights(), one.get_weights(), one.weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=w.path)
    evaluated = many.evaluate(x, y, batch_size=B, return_dict=True, verbose=0)
    for key in want_evaluated:
        np.testing.assert_allclose(evaluated[key], want_evaluated[key], rtol=1e-5, atol=1e-6,
                                   err_msg=f"evaluate: {key}")


@pytest.mark.parametrize("towers", [2, 4])
def test_a_masked_loss_with_unequal_padding_trains_as_the_joined_batch(towers):
    _towers_train_as_the_joined_batch(*_sequences(), towers=towers)


@pytest.mark.parametrize("towers", [2, 4])
@pytest.mark.parametrize("kind", ["own_count", "tied_embedding"])
def test_a_count_normalised_loss_of_ones_own_and_a_tied_embedding_train_as_the_joined_batch(
        kind, towers):
    _towers_train_as_the_joined_batch(*_sequences(), towers=towers, kind=kind)


def test_a_tower_without_a_batch_in_the_last_step_still_divides_by_the_joined_count():
    """20 rows in batches of 4 on 2 towers: the last step has one batch, and
    the empty tower must still join the divisor's all-reduce."""
    x, y = _sequences()
    _towers_train_as_the_joined_batch(np.concatenate([x, x[:4]]), np.concatenate([y, y[:4]]))


def test_one_tower_divides_a_masked_loss_as_stock_keras():
    """With SGD: on TensorFlow, stock Keras's Adam takes an embedding's
    repeated tokens as duplicate slices, which kerastower sums (item 1)."""
    x, y = _sequences()
    tower = _masked_lstm(1, optimizer=lambda: keras.optimizers.SGD(0.5))
    keras.utils.set_random_seed(3)
    inputs = keras.Input((T,), dtype="int32")
    h = keras.layers.LSTM(8, return_sequences=True)(keras.layers.Embedding(VOCAB, 5, mask_zero=True)(inputs))
    stock = keras.Model(inputs, keras.layers.Dense(VOCAB)(h))
    stock.compile(optimizer=keras.optimizers.SGD(0.5), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    stock.set_weights(tower.get_weights())
    want = stock.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0).history
    got = tower.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0).history
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7, err_msg=key)
    for a, b in zip(tower.get_weights(), stock.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_recurrent_model_without_padding_trains_as_the_joined_batch():
    """Every tower counts as many tokens here, so the towers' mean is the
    joined batch's loss. On JAX it also needs the LSTM's scan to trace
    inside the towers' shard_map: its zero initial state, the same on every
    tower, used to clash with its carry, each tower's own ("scan body
    function carry input and carry output must have equal types")."""
    full = np.random.default_rng(1).integers(1, VOCAB, (16, T)).astype("int32")
    _towers_train_as_the_joined_batch(full, np.roll(full, -1, axis=1))


def test_with_jit_compile_a_masked_loss_still_divides_by_the_joined_count():
    """On TensorFlow the divisor's all-reduce cannot run inside XLA: the
    towers' steps run uncompiled, and say so once."""
    import warnings

    from tests.helpers.common import BACKEND

    x, y = _sequences()
    one = _masked_lstm(1)
    start = one.get_weights()
    want = one.fit(x, y, batch_size=2 * B, epochs=2, shuffle=False, verbose=0).history
    keras.utils.set_random_seed(3)
    with kt.distributed("mirrored", devices=tower_devices(2)):
        inputs = keras.Input((T,), dtype="int32")
        h = keras.layers.LSTM(8, return_sequences=True)(
            keras.layers.Embedding(VOCAB, 5, mask_zero=True)(inputs))
        many = kt.TowerModel(inputs, keras.layers.Dense(VOCAB)(h))
        many.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"], jit_compile=True,
                     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    many.set_weights(start)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = many.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0).history
    said = [w for w in caught if "jit_compile does not compile" in str(w.message)]
    assert len(said) == (1 if BACKEND == "tensorflow" else 0)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for a, b in zip(many.get_weights(), one.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
