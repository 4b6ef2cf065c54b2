"""What kerastower's fit costs, measured side by side in one process.

    python benchmarks/overhead.py [--batch 64] [--steps 150] [--rounds 3]

Prints samples/s for four runs on the same model and per-tower batch, and
two ratios, of wall-clock samples/s and of samples per CPU-second:
  (a) TowerModel.fit on one device / a bare tf.function train step on
      constant tensors: how close fit comes to the limit;
  (b) TowerModel.fit on 2 towers / stock Keras fit under MirroredStrategy on
      the same 2 devices with the same total batch.
Runs alternate; each round measures all four, ratios are taken within a
round (a VM's speed drifts between rounds), and medians are reported.
Without GPUs, the CPU is split into 2 logical devices.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402


def devices():
    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= 2:
        return ["/gpu:0", "/gpu:1"], "2 GPUs"
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(2)]
    )
    return ["/cpu:0", "/cpu:1"], "2 logical CPU devices"


def convnet(model_cls):
    import keras

    inputs = keras.Input((32, 32, 3))
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(128, activation="relu")(h)
    return model_cls(inputs, keras.layers.Dense(10)(h))


def compile_model(model):
    import keras

    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def batch_of(size):
    import numpy as np

    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(size, 32, 32, 3)).astype("float32"),
        rng.integers(0, 10, size).astype("int32"),
    )


def timed(run, steps):
    """(wall seconds, process CPU seconds) of `steps` steps after a warm-up."""
    run(5)  # trace and warm up
    wall, cpu = time.perf_counter(), time.process_time()
    run(steps)
    return time.perf_counter() - wall, time.process_time() - cpu


def bare_step_runner(batch):
    import keras

    model = compile_model(convnet(keras.Model))
    x, y = (tf.constant(t) for t in batch)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.optimizer.build(model.trainable_variables)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply(grads, model.trainable_variables)
        return loss

    def run(steps):
        for _ in range(steps):
            loss = step()
        float(loss)

    return run


def tower_fit_runner(strategy_name, devs, batch):
    import kerastower as kt

    with kt.distributed(strategy_name, devices=devs):
        model = compile_model(convnet(kt.TowerModel))
    source = kt.DummyConstantInput(batch)

    def run(steps):
        model.fit(source, steps_per_epoch=steps, epochs=1, verbose=0)

    return run


def stock_fit_runner(devs, global_batch):
    import keras

    cross_ops = None if "gpu" in devs[0] else tf.distribute.ReductionToOneDevice()
    strategy = tf.distribute.MirroredStrategy(devs, cross_device_ops=cross_ops)
    with strategy.scope():
        model = compile_model(convnet(keras.Model))
    dataset = tf.data.Dataset.from_tensors(global_batch).repeat()

    def run(steps):
        model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0, shuffle=False)

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="per-tower batch")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    devs, where = devices()

    one_batch = batch_of(args.batch)
    two_batch = batch_of(2 * args.batch)
    runners = {
        "bare tf.function step, 1 device": (bare_step_runner(one_batch), args.batch),
        "TowerModel.fit, 1 device": (tower_fit_runner("single", None, one_batch), args.batch),
        "TowerModel.fit, 2 towers": (tower_fit_runner("mirrored", devs, one_batch), 2 * args.batch),
        "stock Keras fit, MirroredStrategy": (stock_fit_runner(devs, two_batch), 2 * args.batch),
    }
    rates = {name: [] for name in runners}
    ratios = {"a": [], "b": [], "a_cpu": [], "b_cpu": []}
    for _ in range(args.rounds):
        wall, cpu = {}, {}
        for name, (run, samples_per_step) in runners.items():
            seconds, cpu_seconds = timed(run, args.steps)
            wall[name] = samples_per_step * args.steps / seconds
            cpu[name] = samples_per_step * args.steps / cpu_seconds
            rates[name].append(wall[name])
        # The VM's speed drifts; ratios within a round drift much less, and
        # ratios of CPU time not at all with the number of cores it gets.
        for suffix, per_second in (("", wall), ("_cpu", cpu)):
            ratios["a" + suffix].append(per_second["TowerModel.fit, 1 device"]
                                        / per_second["bare tf.function step, 1 device"])
            ratios["b" + suffix].append(per_second["TowerModel.fit, 2 towers"]
                                        / per_second["stock Keras fit, MirroredStrategy"])

    print(f"devices: {where}; per-tower batch {args.batch}; "
          f"{args.steps} steps x {args.rounds} rounds (medians)")
    for name, r in rates.items():
        print(f"  {name:36s} {statistics.median(r):10.1f} samples/s")
    labels = {
        "a": "(a) TowerModel.fit 1 device / bare step",
        "b": "(b) TowerModel.fit 2 towers / stock Keras fit",
    }
    for key, label in labels.items():
        print(f"{label:47s} wall {statistics.median(ratios[key]):.3f}   "
              f"CPU time {statistics.median(ratios[key + '_cpu']):.3f}")


if __name__ == "__main__":
    main()
