"""fit's cost per step where the step itself is almost free: what the loop,
the engine and the input add around it, on either backend.

    python benchmarks/step_overhead.py                     # TensorFlow
    KERAS_BACKEND=jax python benchmarks/step_overhead.py   # JAX

Prints the best of 3 fits' milliseconds per step: a tiny MLP on 2 towers
(2 logical CPUs, or 2 forced JAX host devices), 8 examples a tower, 400
steps from numpy arrays. To compare two commits, run it in turn from a
worktree of each (`git worktree add /tmp/old <rev>`, then
`PYTHONPATH=/tmp/old python benchmarks/step_overhead.py` from /tmp/old),
alternating a few times: the machine drifts more between minutes than
between two neighbouring runs (benchmarks/RESULTS.md).
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if os.environ.get("KERAS_BACKEND") == "jax":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2").strip()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerastower as kt  # noqa: E402

STEPS, PER_TOWER, TOWERS = 400, 8, 2


def main():
    devices = None
    if keras.backend.backend() == "tensorflow":
        kt.use_cpu_towers(TOWERS)
        devices = [f"/cpu:{i}" for i in range(TOWERS)]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * PER_TOWER * TOWERS, 16)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    with kt.distributed("mirrored", devices=devices):
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(32, activation="relu")(inputs)
        model = kt.TowerModel(inputs, keras.layers.Dense(2)(hidden))
        model.compile(optimizer="sgd",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x[:1600], y[:1600], batch_size=PER_TOWER, verbose=0)   # traces, warms up
        times = []
        for _ in range(3):
            start = time.perf_counter()
            model.fit(x, y, batch_size=PER_TOWER, verbose=0)
            times.append((time.perf_counter() - start) / STEPS * 1e3)
    print(f"{keras.backend.backend()}: {min(times):.3f} ms a step "
          f"({TOWERS} towers x {PER_TOWER}, tiny MLP, best of 3 x {STEPS} steps)")


if __name__ == "__main__":
    main()
