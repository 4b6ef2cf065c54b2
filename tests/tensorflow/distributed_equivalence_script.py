"""One process of a 2-process run (Horovod rank or multi-worker worker) of a
subset of the equivalence matrix; run by test_equivalence_distributed.

    horovodrun -np 2 -H localhost:2 --gloo python distributed_equivalence_script.py OUT horovod
    TF_CONFIG=... python distributed_equivalence_script.py OUT multiworker

Writes, per process, each case's initial and final weights and its logs.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import kerastower as kt  # noqa: E402

out, strategy_name = sys.argv[1], sys.argv[2]
switch = kt.distributed(strategy_name)  # multiworker: before any other TF op
strategy = switch.__enter__()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.helpers.equivalence_cases import B  # noqa: E402
from tests.helpers.equivalence_cases import DISTRIBUTED_SUBSET as SUBSET  # noqa: E402
from tests.helpers.equivalence_cases import fit_case  # noqa: E402

def process_index():
    if strategy_name == "multiworker":
        return strategy.worker_index
    return strategy.tower_index()


def seen_ids():
    """Ids of the examples this process trained on in one shuffled pass,
    with numpy seeded differently on every process."""
    np.random.seed(100 + process_index())
    ids = []

    class Record(keras.layers.Layer):
        def call(self, x):
            def record(values):
                ids.extend(int(v) for v in values)
                return np.int32(0)

            token = tf.numpy_function(record, [x[:, 0]], tf.int32, stateful=True)
            with tf.control_dependencies([token]):
                return tf.identity(x)

    inputs = keras.Input((2,))
    model = kt.TowerModel(inputs, keras.layers.Dense(1)(Record()(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    x = np.stack([np.arange(64), np.ones(64)], axis=1).astype("float32")
    model.fit(x, np.zeros((64, 1), "float32"), batch_size=4, epochs=1, shuffle=True, verbose=0)
    return ids


def main():
    index = process_index()
    results = {"towers": strategy.num_towers, "seen_ids": seen_ids()}
    for case, optimizer_name in SUBSET:
        with open(os.path.join(out, f"initial_{case}.npz"), "rb") as f:
            initial = list(np.load(f).values())
        if index == 1:  # the chief's weights must win
            initial = [w + 1.0 for w in initial]
        model, logs = fit_case(case, optimizer_name, B, initial)
        np.savez(os.path.join(out, f"final_{case}_{optimizer_name}_{index}.npz"), *model.get_weights())
        results[f"{case}/{optimizer_name}"] = {k: [float(v) for v in values] for k, values in logs.items()}
    with open(os.path.join(out, f"results_{index}.json"), "w") as f:
        json.dump(results, f)
    switch.__exit__(None, None, None)


if __name__ == "__main__":
    main()
