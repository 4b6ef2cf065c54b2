"""The JAX backend's ratios: kt-JAX fit against a bare jitted step and stock Keras.

    KERAS_BACKEND=jax python benchmarks/jax_run.py [--steps 40] [--rounds 7]
        [--models small_mlp,mlp,convnet,resnet50] [--batch 64] [--towers 2] [--spe 8]
        [--data-steps 64] [--fixed-rounds 15] [--dtype mixed_bfloat16]

On a GPU, the ResNet-50 anchor (docs/performance.md says how to send Keras
to a machine that has JAX only):

    KERAS_BACKEND=jax python benchmarks/jax_run.py --models resnet50 --batch 256 \
        --dtype mixed_bfloat16 --towers 1 --data-steps 1 --steps 30 --rounds 3

The bare step is what a JAX user writes by hand: one `jax.jit` of the
model's `stateless_call`, `jax.value_and_grad` and the optimizer's
`stateless_apply`, its state donated, on a batch already on the device.
kt-JAX fit runs one tower on one device from numpy arrays (what a user
passes), and with `--towers N` also N towers on N devices (forced host
devices on a CPU: they share its cores). Stock Keras-JAX `fit` runs the same
model from the same arrays. The spe rows run kt-JAX and stock Keras-JAX fit
with `steps_per_execution` (K steps in one jitted call). The other rows time
steps with a callback's batch hook, which makes both fits wait for each
step's logs; the verbose=1 row is fit as most users call it (a progress bar,
no callback of their own), each fit timed whole. The evaluate and predict
rows time whole calls of as many batches (verbose=0), stock Keras-JAX's
against kt-JAX's on one device. Ratios are taken round by round in one process
(harness.py), rates in samples per second.
"""

import argparse
import functools
import os
import platform
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import models  # noqa: E402

import kerastower as kt  # noqa: E402


def bare_jax_step(model, x, y):
    """A hand-written jitted train step on device-resident constants."""
    model.optimizer.build(model.trainable_variables)
    loss_fn = model.loss
    state = [
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
    ]
    x, y = jax.device_put(x), jax.device_put(y)

    def loss_of(trainable, non_trainable, x, y):
        outputs, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return loss_fn(y, outputs), non_trainable

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(trainable, non_trainable, optimizer_state, x, y):
        (loss, non_trainable), grads = jax.value_and_grad(loss_of, has_aux=True)(
            trainable, non_trainable, x, y)
        trainable, optimizer_state = model.optimizer.stateless_apply(optimizer_state, grads, trainable)
        return loss, trainable, non_trainable, optimizer_state

    def run():
        loss, *new_state = step(*state, x, y)
        state[:] = new_state
        return loss

    return run


def fit_runner(model, x, y, batch):
    return harness.fit_runner(lambda steps, callbacks: model.fit(
        x, y, batch_size=batch, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=callbacks))


def progress_bar_runner(model, x, y, batch):
    """fit as most users call it: verbose=1 (a progress bar), no callback
    of their own; each fit timed whole."""
    return harness.whole_fit_runner(lambda steps, callbacks: model.fit(
        x, y, batch_size=batch, steps_per_epoch=steps, epochs=1, verbose=1, callbacks=callbacks))


def inference_runners(model, x, y, batch):
    """evaluate and predict of `steps` batches, verbose=0, each call timed whole."""
    evaluate = harness.whole_call_runner(lambda steps: model.evaluate(
        x[:steps * batch], y[:steps * batch], batch_size=batch, verbose=0))
    predict = harness.whole_call_runner(lambda steps: model.predict(
        x[:steps * batch], batch_size=batch, verbose=0))
    return evaluate, predict


def rows_for(build, batch, towers, steps, rounds, spe=8, data_steps=64, fixed_rounds=15):
    # Stock Keras fit stops where arrays end: they hold every step a fit takes.
    data_steps = max(data_steps, harness.WARMUP + steps + spe)
    x, y = models.examples(build, data_steps * batch * max(towers, 1))
    # jit_compile=False would make stock Keras-JAX run its step eagerly;
    # kerastower's JAX step is always one jax.jit.
    with kt.distributed("single", devices=[0]):
        tower_model = models.compile_model(build(kt.TowerModel), jit_compile=True)
        unchecked = models.compile_model(build(kt.TowerModel), jit_compile=True, check_finite=False)
        several = models.compile_model(build(kt.TowerModel), jit_compile=True, steps_per_execution=spe)
    bare = models.compile_model(build(keras.Model), jit_compile=True)
    stock = models.compile_model(build(keras.Model), jit_compile=True)
    stock_several = models.compile_model(build(keras.Model), jit_compile=True, steps_per_execution=spe)
    runners = {
        "bare": (harness.loop_runner(bare_jax_step(bare, x[:batch], y[:batch])), batch),
        "kt": (fit_runner(tower_model, x, y, batch), batch),
        "kt unchecked": (fit_runner(unchecked, x, y, batch), batch),
        "stock": (fit_runner(stock, x, y, batch), batch),
        "kt spe": (fit_runner(several, x, y, batch), batch),
        "stock spe": (fit_runner(stock_several, x, y, batch), batch),
        "kt verbose=1": (progress_bar_runner(tower_model, x, y, batch), batch),
        "stock verbose=1": (progress_bar_runner(stock, x, y, batch), batch),
    }
    for who, model in (("kt", tower_model), ("stock", stock)):
        evaluate, predict = inference_runners(model, x, y, batch)
        runners[f"{who} evaluate"], runners[f"{who} predict"] = (evaluate, batch), (predict, batch)
    if towers > 1:
        with kt.distributed("mirrored", devices=list(range(towers))):
            many = models.compile_model(build(kt.TowerModel), jit_compile=True)
        runners["kt towers"] = (fit_runner(many, x, y, batch), towers * batch)
    result = harness.compare(runners, steps, rounds)
    name = build.__name__
    rows = [
        (f"JAX {name}", "kt fit 1 device / bare jitted step", "kt", "bare", 0.98),
        (f"JAX {name}", "kt fit 1 device / stock Keras-JAX fit", "kt", "stock", 1.0),
        (f"JAX {name}", "kt fit, check_finite=False / bare jitted step", "kt unchecked", "bare", None),
        (f"JAX {name}", f"kt fit, steps_per_execution={spe} / bare jitted step", "kt spe", "bare", 0.98),
        (f"JAX {name}", f"kt fit / stock Keras-JAX fit, both steps_per_execution={spe}", "kt spe",
         "stock spe", 1.0),
        (f"JAX {name}", "kt fit / stock Keras-JAX fit, both verbose=1 (the progress bar), timed whole",
         "kt verbose=1", "stock verbose=1", 1.0),
        (f"JAX {name}", "kt evaluate / stock Keras-JAX evaluate, verbose=0, timed whole",
         "kt evaluate", "stock evaluate", 1.0),
        (f"JAX {name}", "kt predict / stock Keras-JAX predict, verbose=0, timed whole",
         "kt predict", "stock predict", 1.0),
    ]
    if towers > 1:
        rows.append((f"JAX {name}", f"kt fit {towers} towers / kt fit 1 device", "kt towers", "kt", None))
    rows = [(case, what, result.ratio(a, b), result.ratio(a, b, cpu=True), goal,
             f"{result.rate('bare'):.0f} samples/s bare" if a == "kt" and b == "bare" else "")
            for case, what, a, b, goal in rows]
    fixed_x, fixed_y = x[:4 * batch], y[:4 * batch]
    with kt.distributed("single", devices=[0]):
        fixed_tower = models.compile_model(build(kt.TowerModel), jit_compile=True)
    fixed_stock = models.compile_model(build(keras.Model), jit_compile=True)
    return rows + harness.fixed_costs(name, fixed_stock, fixed_tower, fixed_x, fixed_y, batch,
                                      fixed_rounds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", default="small_mlp,mlp,convnet")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--towers", type=int, default=min(2, len(jax.devices())))
    parser.add_argument("--spe", type=int, default=8, help="steps_per_execution of the spe rows")
    parser.add_argument("--data-steps", type=int, default=64,
                        help="steps of examples in the arrays, at least those a fit takes")
    parser.add_argument("--fixed-rounds", type=int, default=15,
                        help="rounds of the fixed-cost rows (a fit costs a few ms: the VM's "
                             "noise needs more rounds than the step rows)")
    parser.add_argument("--dtype", default="float32",
                        help="Keras dtype policy, e.g. mixed_bfloat16 (the GPU anchor)")
    args = parser.parse_args()
    if keras.backend.backend() != "jax":
        raise SystemExit("Run with KERAS_BACKEND=jax.")
    keras.mixed_precision.set_global_policy(args.dtype)
    devices = jax.devices()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{len(devices)} {devices[0].platform} device(s) ({devices[0].device_kind}); "
          f"Python {platform.python_version()}, JAX {jax.__version__}, Keras {keras.__version__}")
    print(f"{args.steps} timed steps x {args.rounds} rounds per runner, batch {args.batch} "
          f"per tower, dtype policy {args.dtype}; medians of per-round ratios\n")
    print("| case | ratio | wall | CPU time | goal | detail |")
    print("|---|---|---|---|---|---|")
    for name in filter(None, args.models.split(",")):
        for case, what, wall, cpu, goal, detail in rows_for(
                getattr(models, name), args.batch, args.towers, args.steps, args.rounds, args.spe,
                args.data_steps, args.fixed_rounds):
            met = "" if goal is None else f">= {goal}" + (" met" if wall >= goal else " NOT met")
            cpu = "-" if cpu is None else f"{cpu:.3f}"
            print(f"| {case} | {what} | {wall:.3f} | {cpu} | {met} | {detail} |", flush=True)


if __name__ == "__main__":
    main()
