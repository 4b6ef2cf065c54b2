"""Sparse gradients equal one device's on every optimizer (issue 27, item 1).

keras.io's text-classification transformer adds a position embedding looked
up with `ops.arange`: on TensorFlow its gradient is a `tf.IndexedSlices`
holding each position once per device. N towers' slices, joined, hold each
position N times, and Keras's Adam (RMSprop, Adagrad, ...) squares the
slices before it sums duplicates: the sum of squares of the towers' parts,
not the square of their sum. kerastower sums duplicate indices after the
reduction, on every strategy: 1 and N towers agree.
"""

import keras
import numpy as np
import pytest

from tests.helpers.common import tower_devices

import kerastower as kt

VOCAB, LENGTH = 30, 8


class TokenAndPositionEmbedding(keras.layers.Layer):
    """keras.io's: token embedding plus a position embedding of ops.arange."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(VOCAB, 8)
        self.positions = keras.layers.Embedding(LENGTH, 8)

    def call(self, x):
        positions = self.positions(keras.ops.arange(0, keras.ops.shape(x)[-1]))
        return self.tokens(x) + positions


class TransformerBlock(keras.layers.Layer):
    """keras.io's, its Dropout at rate 0: towers draw their own noise."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
        self.ffn = keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(8)])
        self.norm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.norm2 = keras.layers.LayerNormalization(epsilon=1e-6)

    def call(self, inputs):
        h = self.norm1(inputs + self.attention(inputs, inputs))
        return self.norm2(h + self.ffn(h))


def _model(towers, optimizer):
    with kt.distributed("mirrored", devices=tower_devices(towers)):
        keras.utils.set_random_seed(6)
        inputs = keras.Input((LENGTH,), dtype="int32")
        h = TokenAndPositionEmbedding()(inputs)
        h = TransformerBlock()(h)
        h = keras.layers.GlobalAveragePooling1D()(h)
        model = kt.TowerModel(inputs, keras.layers.Dense(2)(h))
        model.compile(optimizer=optimizer(), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.02),
    "adamw": lambda: keras.optimizers.AdamW(0.02),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.02),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_position_embedding_trains_on_n_towers_as_on_one_device(optimizer):
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, (64, LENGTH)).astype("int32")
    y = rng.integers(0, 2, 64).astype("int32")
    one = _model(1, OPTIMIZERS[optimizer])
    start = [w.copy() for w in one.get_weights()]
    want = one.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    moved = max(float(np.abs(a - b).max()) for a, b in zip(one.get_weights(), start))
    assert moved > 1e-2
    # 4 towers with Adam only: the optimizers get the same gradients either way.
    for towers in (2, 4) if optimizer == "adam" else (2,):
        many = _model(towers, OPTIMIZERS[optimizer])
        got = many.fit(x, y, batch_size=16 // towers, epochs=2, shuffle=False, verbose=0).history
        for a, b, w in zip(one.get_weights(), many.get_weights(), one.weights):
            np.testing.assert_allclose(b, a, atol=1e-5, err_msg=f"{towers} towers: {w.path}")
        for key in want:
            np.testing.assert_allclose(got[key], want[key], atol=1e-5, err_msg=key)
