"""The cost of summing duplicate indices of sparse gradients (issue 27).

    python benchmarks/sparse_gradients.py

An embedding-heavy model on TensorFlow (vocabulary 50,000 x 64, sequences
of 32 tokens, keras.io's token and position embedding, 32 examples a
tower) trained with Adam on 1 and 2 towers (logical CPUs), with
kerastower's duplicate summing on (the default: every index reaches the
optimizer once, so N towers equal one device) and off (the towers' slices
joined as they come). Prints the best of 5 fits' milliseconds per step for
each, taken alternately in one process, and the median of the rounds'
ratios. (JAX's gradients of an embedding are dense arrays: there is
nothing to sum there.)
"""

import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerastower as kt  # noqa: E402
from kerastower.backend.tensorflow import gradients  # noqa: E402
from harness import best_ms_on_and_off  # noqa: E402

VOCAB, DIM, LENGTH, PER_TOWER, STEPS = 50_000, 64, 32, 32, 60


class TokenAndPositionEmbedding(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(VOCAB, DIM)
        self.positions = keras.layers.Embedding(LENGTH, DIM)

    def call(self, x):
        return self.tokens(x) + self.positions(keras.ops.arange(0, LENGTH))


def _model(devices):
    with kt.distributed("mirrored", devices=devices):
        inputs = keras.Input((LENGTH,), dtype="int32")
        h = keras.layers.GlobalAveragePooling1D()(TokenAndPositionEmbedding()(inputs))
        model = kt.TowerModel(inputs, keras.layers.Dense(2)(h))
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main():
    kt.use_cpu_towers(2)
    rng = np.random.default_rng(0)
    for towers in (1, 2):
        n = STEPS * PER_TOWER * towers
        x = rng.integers(0, VOCAB, (n, LENGTH)).astype("int32")
        y = rng.integers(0, 2, n).astype("int32")
        devices = [f"/cpu:{i}" for i in range(towers)]

        def switch(summed):
            gradients.SUM_DUPLICATES = summed       # read when the step is traced

        on, off, ratio = best_ms_on_and_off(lambda: _model(devices), switch, x, y, PER_TOWER, towers,
                                               rounds=5)
        print(f"{towers} tower(s): duplicates summed {on:.2f} ms a step, joined as they come "
              f"{off:.2f} ms; median ratio of 5 rounds {ratio:.3f} (speed with summing / without)")


if __name__ == "__main__":
    main()
