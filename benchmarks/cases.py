"""The comparisons of `benchmarks/run.py`, each returning rows of the table.

A row is (case, ratio name, wall ratio, CPU-time ratio, goal or None, detail).
"""

import time

import keras
import numpy as np
import tensorflow as tf

import kerastower as kt

import harness
import models

POOL = 16  # batches of data behind each array input (a pass is POOL steps)


def _tower_model(strategy, build, devices=None, **compile_args):
    with kt.distributed(strategy, devices=devices):
        return models.compile_model(build(kt.TowerModel), **compile_args)


def _fit_arrays(model, x, y, batch):
    return lambda steps, cbs: model.fit(
        x, y, batch_size=batch, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=cbs)


def _fit_source(model, source):
    return lambda steps, cbs: model.fit(
        source, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=cbs)


def _pipeline(x, y, batch):
    """A tf.data pipeline of ready batches, prefetched as keras.io's examples
    do: what it costs to make them (the user's decoding, augmenting) is not
    kerastower's cost, pulling them is."""
    n = len(x) // batch
    return tf.data.Dataset.from_tensor_slices((
        x[:n * batch].reshape((n, batch) + x.shape[1:]), y[:n * batch].reshape(n, batch),
    )).repeat().prefetch(2)


def fit_vs_bare(build, batch, steps, rounds):
    """P1: TowerModel.fit on one device, from numpy arrays and from tf.data,
    against a bare compiled step on constant tensors; with fit's NaN check
    of the gradients (the default) and without it (`check_finite=False`,
    like the bare step)."""
    x, y = models.examples(build, POOL * batch)
    bare = models.compile_model(build(keras.Model))
    bare_xla = models.compile_model(build(keras.Model))
    bare_xla.tower_jit_compile = True
    checked = _tower_model("single", build)
    unchecked = _tower_model("single", build, check_finite=False)
    fit_xla = _tower_model("single", build, jit_compile=True, check_finite=False)
    runners = {
        "bare": (harness.loop_runner(harness.bare_step(bare, x[:batch], y[:batch])), batch),
        "numpy": (harness.fit_runner(_fit_arrays(unchecked, x, y, batch)), batch),
        "tf.data": (harness.fit_runner(_fit_source(unchecked, _pipeline(x, y, batch))), batch),
        "numpy checked": (harness.fit_runner(_fit_arrays(checked, x, y, batch)), batch),
        "tf.data checked": (harness.fit_runner(_fit_source(checked, _pipeline(x, y, batch))), batch),
        "bare xla": (harness.loop_runner(harness.bare_step(bare_xla, x[:batch], y[:batch])), batch),
        "numpy xla": (harness.fit_runner(_fit_arrays(fit_xla, x, y, batch)), batch),
    }
    result = harness.compare(runners, steps, rounds)
    name = build.__name__
    rows = [
        (f"P1 {name}, numpy, XLA", "fit 1 device / bare step, both XLA",
         result.ratio("numpy xla", "bare xla"), result.ratio("numpy xla", "bare xla", cpu=True),
         None, f"{result.rate('bare xla'):.0f} samples/s bare with XLA"),
    ]
    for source in ("numpy", "tf.data"):
        rows.append((f"P1 {name}, {source}", "fit 1 device / bare step", result.ratio(source, "bare"),
                     result.ratio(source, "bare", cpu=True), 0.98,
                     f"{result.rate('bare'):.0f} samples/s bare" if source == "numpy" else ""))
        rows.append((f"P1 {name}, {source}, NaN check", "fit (default check_finite) / bare step",
                     result.ratio(f"{source} checked", "bare"),
                     result.ratio(f"{source} checked", "bare", cpu=True), None, ""))
    return rows


def stock_keras_fit(build, devices, x, y, global_batch, jit_compile=False):
    """Stock Keras fit under MirroredStrategy on `devices`, global batch."""
    cross_ops = None if "gpu" in devices[0].lower() else tf.distribute.ReductionToOneDevice()
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_ops)
    with strategy.scope():
        model = models.compile_model(build(keras.Model), jit_compile=jit_compile)
    dataset = _pipeline(x, y, global_batch)
    return lambda steps, cbs: model.fit(
        dataset, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=cbs)


def stock_keras_can_jit(build, devices, batch):
    """Whether stock Keras fit runs with jit_compile=True under
    MirroredStrategy (its "auto" turns XLA off there); the error if not."""
    x, y = models.examples(build, 4 * batch)
    try:
        stock_keras_fit(build, devices, x, y, 2 * batch, jit_compile=True)(2, [])
    except Exception as error:  # noqa: BLE001 - what failed is the finding
        lines = [line for line in str(error).splitlines() if line.strip()]
        return f"no: {type(error).__name__}: {lines[-3][:140] if len(lines) >= 3 else lines[-1][:140]}"
    return "yes"


def towers_vs_stock(build, devices, batch, steps, rounds, with_xla=False):
    """P2: 2 towers against stock Keras fit on the same 2 devices and total
    batch, without XLA on both sides; `with_xla` adds the towers with XLA
    (stock Keras cannot use XLA under MirroredStrategy: see
    `stock_keras_can_jit`)."""
    x, y = models.examples(build, POOL * batch * 2)
    runners = {
        "stock": (harness.fit_runner(stock_keras_fit(build, devices, x, y, 2 * batch)), 2 * batch),
        "towers": (harness.fit_runner(_fit_arrays(
            _tower_model("mirrored", build, devices), x, y, batch)), 2 * batch),
    }
    if with_xla:
        runners["towers+xla"] = (harness.fit_runner(_fit_arrays(
            _tower_model("mirrored", build, devices, jit_compile=True), x, y, batch)), 2 * batch)
    result = harness.compare(runners, steps, rounds)
    name = build.__name__
    rows = [(f"P2 {name}", "2 towers / stock Keras, no XLA", result.ratio("towers", "stock"),
             result.ratio("towers", "stock", cpu=True), None if with_xla else 1.10,
             f"{result.rate('stock'):.0f} samples/s stock")]
    if with_xla:
        rows.append((f"P2 {name}", "2 towers with XLA / stock Keras", result.ratio("towers+xla", "stock"),
                     result.ratio("towers+xla", "stock", cpu=True), 1.10,
                     "stock Keras with jit_compile=True: " + stock_keras_can_jit(build, devices, batch)))
    return rows


def _python_source(x, y, batch, seconds, busy):
    def batches():
        index = 0
        while True:
            deadline = time.perf_counter() + seconds
            if busy:
                while time.perf_counter() < deadline:
                    pass
            else:
                time.sleep(seconds)
            start = (index % POOL) * batch
            index += 1
            yield x[start:start + batch], y[start:start + batch]

    signature = (tf.TensorSpec((batch,) + x.shape[1:], tf.float32),
                 tf.TensorSpec((batch,), tf.int32))
    return batches, signature


def generator_overlap(build, batch, steps, rounds, seconds=0.002):
    """P3: a Python source spending `seconds` per batch (waiting, as on I/O;
    and computing, holding the GIL) against a constant input."""
    x, y = models.examples(build, POOL * batch)
    model = _tower_model("single", build)
    runners = {"constant": (harness.fit_runner(_fit_source(
        model, kt.DummyConstantInput((x[:batch], y[:batch])))), batch)}
    for label, busy in (("waiting", False), ("computing", True)):
        for prefetch in (0, 4):
            fn, signature = _python_source(x, y, batch, seconds, busy)
            source = kt.GeneratorInput(fn, signature, prefetch=prefetch)
            runners[f"{label}, prefetch {prefetch}"] = (
                harness.fit_runner(_fit_source(model, source)), batch)
    result = harness.compare(runners, steps, rounds)
    step_ms = 1000 * batch / result.rate("constant")
    rows = []
    for label in ("waiting", "computing"):
        for prefetch in (4, 0):
            name = f"{label}, prefetch {prefetch}"
            rows.append((f"P3 {build.__name__}, source {label} {seconds * 1000:.0f} ms",
                         f"GeneratorInput prefetch={prefetch} / constant",
                         result.ratio(name, "constant"), result.ratio(name, "constant", cpu=True),
                         0.95 if (prefetch and label == "waiting") else None,
                         f"step {step_ms:.1f} ms" if (prefetch and label == "waiting") else ""))
    return rows


def xla_gain(build, devices, batch, steps, rounds):
    """TowerModel.fit with jit_compile=True against False, on one device
    and on 2 towers."""
    x, y = models.examples(build, POOL * batch)
    runners = {}
    for strategy, devs in (("single", None), ("mirrored", devices)):
        for jit in (False, True):
            model = _tower_model(strategy, build, devs, jit_compile=jit)
            towers = model.num_towers
            runners[(strategy, jit)] = (
                harness.fit_runner(_fit_arrays(model, x, y, batch)), towers * batch)
    result = harness.compare(runners, steps, rounds)
    return [
        (f"XLA {build.__name__}", f"jit_compile=True / False, {label}",
         result.ratio((strategy, True), (strategy, False)),
         result.ratio((strategy, True), (strategy, False), cpu=True), None,
         f"{result.rate((strategy, False)):.0f} samples/s without XLA")
        for strategy, label in (("single", "1 device"), ("mirrored", "2 towers"))
    ]


def steps_per_execution(build, batch, steps, rounds):
    """fit with steps_per_execution=8 against 1, on a cheap step."""
    x, y = models.examples(build, POOL * batch)
    runners = {
        k: (harness.fit_runner(_fit_arrays(
            _tower_model("single", build, steps_per_execution=k), x, y, batch), warmup=8), batch)
        for k in (1, 8)
    }
    result = harness.compare(runners, steps, rounds)
    return [(f"steps_per_execution {build.__name__}", "8 / 1", result.ratio(8, 1),
             result.ratio(8, 1, cpu=True), None,
             f"{1000 * batch / result.rate(1):.2f} ms per step at 1")]


def scaling(build, all_devices, batch, steps, rounds):
    """Samples/s of 1, 2 and 4 towers (per-tower batch fixed) against 1."""
    x, y = models.examples(build, POOL * batch)
    runners = {}
    for n in (1, 2, 4):
        if n > len(all_devices):
            continue
        model = _tower_model("mirrored" if n > 1 else "single", build,
                             all_devices[:n] if n > 1 else None)
        runners[n] = (harness.fit_runner(_fit_arrays(model, x, y, batch)), n * batch)
    result = harness.compare(runners, steps, rounds)
    return [(f"scaling {build.__name__}", f"{n} towers / 1 device", result.ratio(n, 1),
             result.ratio(n, 1, cpu=True), None, f"{result.rate(n):.0f} samples/s")
            for n in runners if n > 1]


def collective_counts(build, devices, batch):
    """What one training step and the logs launch, per strategy (this process)."""
    x, y = models.examples(build, POOL * batch)
    rows = {}
    for strategy, devs in (("single", None), ("mirrored", devices)):
        model = _tower_model(strategy, build, devs)
        model.fit(x, y, batch_size=batch, steps_per_epoch=2, verbose=0)
        rows[strategy] = kt.collectives_per_step(model)
    return rows


def measured_rate(build, strategy, devices, batch, steps):
    """Median samples/s of TowerModel.fit under `strategy` (for comparing
    with another process, e.g. Horovod's)."""
    x, y = models.examples(build, POOL * batch)
    model = _tower_model(strategy, build, devices)
    run = harness.fit_runner(_fit_arrays(model, x, y, batch))
    rates = []
    for _ in range(3):
        wall, _, timed = run(steps)
        rates.append(model.num_towers * batch * timed / wall)
    return float(np.median(rates)), model


class _OneCostTrainer(kt.Trainer):
    """The step fit runs, written as a kt.Trainer's run_step."""

    def run_step(self):
        return self.hooked_run(self.train_step, self.next_batches())

    @kt.Trainer.tower_function
    def train_step(self, data):
        model = self.model
        x, y = data
        with tf.GradientTape() as tape:
            loss = model.tower_loss(x, y, model(x, training=True))
        model.optimizer.apply(tape.gradient(loss, model.trainable_weights))
        return {"loss": loss}


def trainer_vs_fit(build, devices, batch, steps, rounds):
    """kt.Trainer's Python loop (one run_step per step, logs read every
    step) against TowerModel.fit on the same 2 towers."""
    x, y = models.examples(build, POOL * batch)
    source = kt.DummyConstantInput((x[:batch], y[:batch]))
    fit_model = _tower_model("mirrored", build, devices)
    trainer_model = _tower_model("mirrored", build, devices)
    trainer_model.fit(source, steps_per_epoch=1, verbose=0)  # builds loss and metrics
    trainer = _OneCostTrainer(trainer_model, source)

    def train(steps, callbacks):
        trainer.train(callbacks=callbacks, steps_per_epoch=steps, starting_epoch=trainer.epoch_num + 1,
                      max_epoch=trainer.epoch_num + 1, verbose=0)

    runners = {
        "fit": (harness.fit_runner(_fit_source(fit_model, source)), 2 * batch),
        "trainer": (harness.fit_runner(train), 2 * batch),
    }
    result = harness.compare(runners, steps, rounds)
    return [(f"kt.Trainer {build.__name__}", "kt.Trainer run_step / TowerModel.fit, 2 towers",
             result.ratio("trainer", "fit"), result.ratio("trainer", "fit", cpu=True), None,
             f"{result.rate('fit'):.0f} samples/s fit")]


def _numpy_loop_step(model, x, y, batch, seed=0):
    """What a hand-written loop over numpy arrays does: each step gathers a
    shuffled batch of rows (`x[rows]`) and calls one compiled train step on
    it; a new permutation every pass. Returns a runner."""
    loss_fn = model.loss
    model.optimizer.build(model.trainable_variables)
    spec = (tf.TensorSpec((batch,) + x.shape[1:], tf.as_dtype(x.dtype)),
            tf.TensorSpec((batch,), tf.as_dtype(y.dtype)))

    @tf.function(input_signature=spec)
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply(grads, model.trainable_variables)
        return loss

    rng = np.random.default_rng(seed)
    batches = len(x) // batch
    state = {"order": rng.permutation(len(x)), "at": 0}

    def one_step():
        if state["at"] == batches:
            state["order"], state["at"] = rng.permutation(len(x)), 0
        rows = state["order"][state["at"] * batch:(state["at"] + 1) * batch]
        state["at"] += 1
        return step(x[rows], y[rows])

    return harness.loop_runner(one_step)


def numpy_input(build, batch, steps, rounds, goal=1.2):
    """P0: `fit(x, y)` from numpy arrays on one device, shuffled (Keras's
    default), kerastower with its default NaN check against stock Keras
    `fit(x, y)` and against the loop of `_numpy_loop_step` (the same
    gathers, the same compiled step, no fit). Each fit is one pass over
    arrays of exactly the steps it takes, as a user's epoch is."""
    from harness import WARMUP

    x, y = models.examples(build, (WARMUP + steps) * batch)
    stock = models.compile_model(build(keras.Model))
    tower = _tower_model("single", build)

    def one_pass(model):
        return lambda _, cbs: model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=cbs)

    runners = {
        "loop": (_numpy_loop_step(models.compile_model(build(keras.Model)), x, y, batch), batch),
        "stock": (harness.fit_runner(one_pass(stock)), batch),
        "kt": (harness.fit_runner(one_pass(tower)), batch),
    }
    result = harness.compare(runners, steps, rounds)
    name = build.__name__
    return [
        (f"P0 {name}, numpy, shuffled", "kt fit 1 device / stock Keras fit", result.ratio("kt", "stock"),
         result.ratio("kt", "stock", cpu=True), goal, f"{result.rate('stock'):.0f} samples/s stock"),
        (f"P0 {name}, numpy, shuffled", "kt fit 1 device / Python loop of numpy gathers + step",
         result.ratio("kt", "loop"), result.ratio("kt", "loop", cpu=True), 0.95 if goal > 1 else None,
         f"{result.rate('loop'):.0f} samples/s loop"),
        (f"P0 {name}, numpy, shuffled", "stock Keras fit / the same loop", result.ratio("stock", "loop"),
         result.ratio("stock", "loop", cpu=True), None, ""),
    ]


def inference(build, batch, steps, rounds):
    """evaluate and predict of numpy arrays on one device (verbose=0),
    each call timed whole: kerastower against stock Keras."""
    x, y = models.examples(build, steps * batch)
    stock = models.compile_model(build(keras.Model))
    tower = _tower_model("single", build)
    runners = {}
    for who, model in (("stock", stock), ("kt", tower)):
        runners[f"{who} evaluate"] = (harness.whole_call_runner(lambda n, m=model: m.evaluate(
            x[:n * batch], y[:n * batch], batch_size=batch, verbose=0)), batch)
        runners[f"{who} predict"] = (harness.whole_call_runner(lambda n, m=model: m.predict(
            x[:n * batch], batch_size=batch, verbose=0)), batch)
    result = harness.compare(runners, steps, rounds)
    name = build.__name__
    return [
        (f"inference {name}, numpy", f"kt {call} / stock Keras {call}, timed whole",
         result.ratio(f"kt {call}", f"stock {call}"), result.ratio(f"kt {call}", f"stock {call}", cpu=True),
         1.0, f"{result.rate(f'stock {call}'):.0f} samples/s stock")
        for call in ("evaluate", "predict")
    ]


def dataset_input(build, batch, steps, rounds):
    """P0: `fit(dataset)` of a finite, shuffled `from_tensor_slices(...).batch()`
    pipeline (keras.io's way, no `.repeat()`) on one device, one pass an
    epoch: kerastower against stock Keras."""
    from harness import WARMUP

    x, y = models.examples(build, (WARMUP + steps) * batch)
    stock = models.compile_model(build(keras.Model))
    tower = _tower_model("single", build)

    def one_pass(model):
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0).batch(batch).prefetch(2)
        return lambda _, cbs: model.fit(dataset, epochs=1, verbose=0, callbacks=cbs)

    runners = {"stock": (harness.fit_runner(one_pass(stock)), batch),
               "kt": (harness.fit_runner(one_pass(tower)), batch)}
    result = harness.compare(runners, steps, rounds)
    return [(f"P0 {build.__name__}, tf.data one pass, shuffled", "kt fit 1 device / stock Keras fit",
             result.ratio("kt", "stock"), result.ratio("kt", "stock", cpu=True), 1.0,
             f"{result.rate('stock'):.0f} samples/s stock")]


def fixed_costs(build, rounds, batch=32):
    """Fixed costs of a `fit` and of an epoch, kerastower on one device
    against stock Keras (harness.fixed_costs)."""
    x, y = models.examples(build, 4 * batch)
    return harness.fixed_costs(build.__name__, models.compile_model(build(keras.Model)),
                               _tower_model("single", build), x, y, batch, rounds)
