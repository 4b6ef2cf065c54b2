"""The cost of dividing masked losses by the joined batch's count (issue 27).

    python benchmarks/token_divisors.py [rounds]

A masked sequence model on TensorFlow (vocabulary 1,000 x 32, sequences of
64 tokens padded to very unequal lengths, Embedding(mask_zero=True), an
LSTM of 64, a masked SparseCategoricalCrossentropy, Adam, 32 examples a
tower) trained on 1 and 2 towers (logical CPUs), with the joined count on
(the default: one all-reduce of (count, examples) per masked loss before
the backward pass, so N towers equal one device) and off (each tower
divides by its own count, as Keras does). Prints the best of the fits'
milliseconds per step for each, taken alternately in one process (15
rounds by default), and the median of the rounds' ratios. One tower has
nothing to all-reduce: its ratio shows the noise.
"""

import os
import sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerastower as kt  # noqa: E402
from kerastower import loss_divisors  # noqa: E402
from harness import best_ms_on_and_off  # noqa: E402

VOCAB, DIM, LENGTH, UNITS, PER_TOWER, STEPS = 1_000, 32, 64, 64, 32, 40
ROUNDS = 15


def _model(devices):
    with kt.distributed("mirrored", devices=devices):
        inputs = keras.Input((LENGTH,), dtype="int32")
        h = keras.layers.Embedding(VOCAB, DIM, mask_zero=True)(inputs)
        h = keras.layers.LSTM(UNITS, return_sequences=True)(h)
        model = kt.TowerModel(inputs, keras.layers.Dense(VOCAB)(h))
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _sequences(n, rng):
    lengths = np.where(np.arange(n) // PER_TOWER % 2 == 0, 4, LENGTH)   # short and full batches
    x = rng.integers(1, VOCAB, (n, LENGTH)).astype("int32")
    x[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
    return x, np.roll(x, -1, axis=1)


def main(rounds=ROUNDS):
    kt.use_cpu_towers(2)
    rng = np.random.default_rng(0)
    for towers in (1, 2):
        x, y = _sequences(STEPS * PER_TOWER * towers, rng)
        devices = [f"/cpu:{i}" for i in range(towers)]

        def switch(joined):
            loss_divisors.JOINED_MASKED_COUNTS = joined     # read when the step is traced

        on, off, ratio = best_ms_on_and_off(lambda: _model(devices), switch, x, y, PER_TOWER, towers,
                                               rounds=rounds)
        print(f"{towers} tower(s): joined count {on:.2f} ms a step, each tower's own "
              f"{off:.2f} ms; median ratio of {rounds} rounds {ratio:.3f} (speed with the joined "
              "count / without)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS)
