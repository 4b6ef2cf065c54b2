"""Timing: steady-state steps, runs interleaved, ratios taken within a round.

A "runner" is a function `run(steps)` that trains for about `steps` steps
and returns (wall seconds, process CPU seconds, steps timed), measured after
a few warm-up steps of the same call (tracing, XLA compilation and the start of
`fit` are left out: they are paid once per run, not per step).

`compare` runs several runners in rounds, alternating their order; within a
round each gets the same conditions, so ratios are taken round by round
and their median reported. On a shared VM the speed drifts between rounds
by up to 2x; the per-round ratio drifts much less.
"""

import contextlib
import io
import statistics
import time

import keras

WARMUP = 3


class StepTimer(keras.callbacks.Callback):
    """Times the steps of one `fit` from the end of step `warmup` on (with
    `steps_per_execution=k`, from the first call ending at or after it)."""

    def __init__(self, warmup=WARMUP):
        super().__init__()
        self.warmup = warmup
        self.start = None
        self.end = None

    def on_train_batch_end(self, batch, logs=None):
        now = (time.perf_counter(), time.process_time(), batch)
        if self.start is None and batch + 1 >= self.warmup:
            self.start = now
        self.end = now

    def seconds(self):
        return (self.end[0] - self.start[0], self.end[1] - self.start[1],
                self.end[2] - self.start[2])


def fit_runner(fit, warmup=WARMUP):
    """A runner from `fit(steps, callbacks)`, which calls some model's fit
    for `steps` steps with `callbacks`."""

    def run(steps):
        timer = StepTimer(warmup)
        fit(warmup + steps, [timer])
        return timer.seconds()

    return run


class FitTimer(keras.callbacks.Callback):
    """Times one whole `fit`, from on_train_begin to on_train_end, with no
    batch hook: what a fit with no per-step reader of its own costs."""

    def on_train_begin(self, logs=None):
        self.start = (time.perf_counter(), time.process_time())

    def on_train_end(self, logs=None):
        self.end = (time.perf_counter(), time.process_time())


def whole_fit_runner(fit, warmup=WARMUP):
    """A runner from `fit(steps, callbacks)` timing the fit from its
    on_train_begin to its on_train_end (its warm-up steps included, so a
    little slower than `fit_runner`'s steps; what a progress bar prints is
    thrown away)."""

    def run(steps):
        timer = FitTimer()
        with contextlib.redirect_stdout(io.StringIO()):
            fit(warmup + steps, [timer])
        return timer.end[0] - timer.start[0], timer.end[1] - timer.start[1], warmup + steps

    return run


def whole_call_runner(call):
    """A runner timing `call(steps)` whole (an `evaluate` or `predict` of
    `steps` steps: its fixed cost included, as a user pays it), warmed up
    once here (tracing is paid once a model)."""
    call(WARMUP)

    def run(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        call(steps)
        return time.perf_counter() - wall, time.process_time() - cpu, steps

    return run


def loop_runner(step):
    """A runner calling `step()` (a tf.function) once per step from Python,
    as a hand-written training loop does."""

    def run(steps):
        for _ in range(WARMUP):
            result = step()
        float(result)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            result = step()
        float(result)
        return time.perf_counter() - wall, time.process_time() - cpu, steps

    return run


def bare_step(model, x, y):
    """A compiled train step on constant tensors: the limit fit aims at."""
    import tensorflow as tf  # the JAX benchmark (jax_run.py) shares this module

    loss_fn = model.loss
    model.optimizer.build(model.trainable_variables)
    x, y = tf.constant(x), tf.constant(y)

    @tf.function(jit_compile=bool(getattr(model, "tower_jit_compile", False)))
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply(grads, model.trainable_variables)
        return loss

    return step


class Result:
    """Per-runner rates and per-round ratios of one comparison."""

    def __init__(self, names):
        self.rates = {name: [] for name in names}
        self.cpu_rates = {name: [] for name in names}

    def rate(self, name):
        return statistics.median(self.rates[name])

    def ratio(self, numerator, denominator, cpu=False):
        rates = self.cpu_rates if cpu else self.rates
        return statistics.median(
            a / b for a, b in zip(rates[numerator], rates[denominator]))


def compare(runners, steps, rounds):
    """Runs `runners` ({name: (run, samples per step)}) for `rounds` rounds
    of `steps` steps each; returns a Result."""
    result = Result(list(runners))
    names = list(runners)
    for index in range(rounds):
        order = names if index % 2 == 0 else names[::-1]
        for name in order:
            run, samples = runners[name]
            wall, cpu, timed = run(steps)
            result.rates[name].append(samples * timed / wall)
            result.cpu_rates[name].append(samples * timed / max(cpu, 1e-9))
    return result


def best_ms_on_and_off(build, switch, x, y, per_tower, towers, rounds=3):
    """A setting's cost: `build()` makes a model with `switch(True)` and one
    with `switch(False)` (the setting is read when a step is traced), each
    warmed up on 4 steps; then whole `fit`s of `x`, `y` alternate between
    them for `rounds` rounds. Returns the best milliseconds per step with
    the setting on, and off, and the median over rounds of the round's
    ratio (off / on: the speed with the setting over without); the
    setting is left on."""
    models = {}
    for on in (True, False):
        switch(on)
        models[on] = build()
        warm = 4 * per_tower * towers
        models[on].fit(x[:warm], y[:warm], batch_size=per_tower, verbose=0)  # traces, warms up
    switch(True)
    steps = len(x) // (per_tower * towers)
    times = {True: [], False: []}
    for _ in range(rounds):
        for on in (True, False):
            start = time.perf_counter()
            models[on].fit(x, y, batch_size=per_tower, shuffle=False, verbose=0)
            times[on].append((time.perf_counter() - start) / steps * 1e3)
    ratios = [off / on for on, off in zip(times[True], times[False])]
    return min(times[True]), min(times[False]), statistics.median(ratios)


def fixed_costs(name, stock, tower, x, y, batch, rounds, epochs=50):
    """What a `fit` costs besides its steps: a `fit` of 1 step, and a `fit`
    of `epochs` epochs of one pass over `x` (a few steps each), stock
    Keras's `stock` against kerastower's `tower`, alternating, each model
    warmed by a fit first (tracing is paid once a model, not per fit).
    Rows give stock seconds / kerastower seconds (>= 1: no worse)."""
    for model in (stock, tower):
        model.fit(x, y, batch_size=batch, epochs=2, verbose=0)
    steps = -(-len(x) // batch)
    plans = {"1 step": dict(x=x[:batch], y=y[:batch], batch_size=batch, epochs=1),
             f"{epochs} epochs x {steps} steps": dict(x=x, y=y, batch_size=batch, epochs=epochs)}
    rows = []
    for label, plan in plans.items():
        seconds = {"stock": [], "kt": []}
        for index in range(rounds):
            order = (("stock", stock), ("kt", tower))
            for who, model in order if index % 2 == 0 else order[::-1]:
                wall = time.perf_counter()
                model.fit(verbose=0, **plan)
                seconds[who].append(time.perf_counter() - wall)
        ratio = statistics.median(s / k for s, k in zip(seconds["stock"], seconds["kt"]))
        rows.append((f"fixed {name}", f"a fit of {label}: stock Keras s / kt s", ratio, None, 1.0,
                     f"{1000 * statistics.median(seconds['kt']):.1f} ms kt, "
                     f"{1000 * statistics.median(seconds['stock']):.1f} ms stock"))
    return rows
