"""The whole ratio table of kerastower's speed, in one command.

    python benchmarks/run.py [--quick] [--only P1,P2,...]

Prints the machine, then one row per comparison: the ratio of samples/s
(wall clock, and per CPU-second) of kerastower against its reference, taken
side by side in this process (Horovod's ranks run as their own processes),
with the goal where the project sets one:

  P0   fit(x, y) from shuffled numpy on one device / stock Keras fit and
       a Python loop of numpy gathers calling the same compiled step;
       fit(dataset) of a finite shuffled pipeline / stock Keras fit
  P1   TowerModel.fit on one device / a bare compiled step on constants
  P2   2 towers / stock Keras fit under MirroredStrategy, same total batch
  P3   GeneratorInput over a slow Python source / a constant input
  XLA  jit_compile=True / False
  spe  steps_per_execution=8 / 1; kt.Trainer's run_step loop / fit
  fixed  a fit of 1 step and of 50 epochs of 4 steps: stock Keras / kerastower
  inf  evaluate and predict of numpy arrays on one device / stock Keras's
  P5   Horovod 2 ranks / mirrored 2 towers; towers 1, 2, 4 / 1 device
and the collectives one step launches under each strategy.
Without GPUs, the CPU is split into 4 logical devices.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kerastower as kt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def setup_devices():
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        return [f"/gpu:{i}" for i in range(len(gpus))], f"{len(gpus)} GPU(s)"
    kt.use_cpu_towers(4)
    return [f"/cpu:{i}" for i in range(4)], "4 logical CPU devices"


def machine(where):
    import keras
    import tensorflow as tf

    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {os.cpu_count()} cores, {where}; Python {platform.python_version()}, "
            f"TensorFlow {tf.__version__}, Keras {keras.__version__}")


def horovod_rows(batch, steps, devices):
    import cases
    import models

    mirrored, _ = cases.measured_rate(models.convnet, "mirrored", devices[:2], batch, steps)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "horovod.json")
        command = ["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                   os.path.join(HERE, "horovod_rate.py"), out, str(batch), str(steps)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + sys.path))
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0 or not os.path.exists(out):
            tail = (done.stdout + done.stderr)[-1500:]
            return [("P5 convnet", "Horovod 2 ranks / mirrored 2 towers", None, None, None,
                     f"horovodrun failed: {tail}")], None
        with open(out) as f:
            horovod = json.load(f)
    return [("P5 convnet", "Horovod 2 ranks / mirrored 2 towers", horovod["rate"] / mirrored,
             None, None, f"{horovod['rate']:.0f} vs {mirrored:.0f} samples/s (separate runs)")
            ], horovod["collectives"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--only", default="", help="comma-separated: P0,P1,P2,P3,XLA,spe,fixed,inf,P5,coll")
    parser.add_argument("--steps", type=int, help="timed steps per run (default 20)")
    parser.add_argument("--rounds", type=int, help="rounds per comparison (default 11)")
    args = parser.parse_args()
    devices, where = setup_devices()

    import cases
    import models

    steps, rounds = (10, 3) if args.quick else (20, 11)
    steps, rounds = args.steps or steps, args.rounds or rounds
    wanted = set(filter(None, args.only.split(","))) or {"P0", "P1", "P2", "P3", "XLA", "spe", "fixed", "inf",
                                                 "P5", "coll"}
    sections = [
        ("P0", lambda: cases.numpy_input(models.mlp256, 128, 2 * steps, rounds)
         + cases.numpy_input(models.convnet, 64, steps, rounds, goal=1.0)
         + cases.numpy_input(models.transformer, 32, steps, rounds, goal=1.0)
         + cases.dataset_input(models.mlp256, 128, 2 * steps, rounds)),
        ("P1", lambda: cases.fit_vs_bare(models.mlp, 256, steps, rounds)
         + cases.fit_vs_bare(models.convnet, 64, steps, rounds)),
        ("P2", lambda: cases.towers_vs_stock(models.small_mlp, devices[:2], 32, steps, rounds)
         + cases.towers_vs_stock(models.convnet, devices[:2], 64, steps, rounds)
         + cases.towers_vs_stock(models.transformer, devices[:2], 32, steps, rounds, with_xla=True)),
        ("P3", lambda: cases.generator_overlap(models.mlp, 64, steps, rounds)),
        ("XLA", lambda: cases.xla_gain(models.transformer, devices[:2], 32, steps, rounds)),
        ("spe", lambda: cases.steps_per_execution(models.small_mlp, 32, 4 * steps, rounds)
         + cases.trainer_vs_fit(models.convnet, devices[:2], 64, steps, rounds)),
        ("fixed", lambda: cases.fixed_costs(models.small_mlp, max(3, rounds // 2))),
        ("inf", lambda: cases.inference(models.mlp256, 128, 4 * steps, rounds)),
        ("P5", lambda: cases.scaling(models.convnet, devices, 64, steps, rounds)),
    ]
    print(f"machine: {machine(where)}")
    print(f"{steps} timed steps x {rounds} rounds per runner; medians of per-round ratios\n")
    print("| case | ratio | wall | CPU time | goal | detail |")
    print("|---|---|---|---|---|---|")

    def show(rows):
        for case, name, wall, cpu, goal, detail in rows:
            cells = [f"{v:.3f}" if v is not None else "-" for v in (wall, cpu)]
            met = "" if goal is None else (f">= {goal}" + (" met" if wall and wall >= goal else " NOT met"))
            print(f"| {case} | {name} | {cells[0]} | {cells[1]} | {met} | {detail} |", flush=True)

    for key, section in sections:
        if key in wanted:
            show(section())
    horovod_collectives = None
    if "P5" in wanted:
        rows, horovod_collectives = horovod_rows(64, steps, devices)
        show(rows)
    if "coll" in wanted:
        counts = cases.collective_counts(models.convnet, devices[:2], 64)
        if horovod_collectives is not None:
            counts["horovod (2 ranks)"] = horovod_collectives
        print("\ncollectives launched (kind, tensors), convnet, static per-tower batch:")
        for strategy, launches in counts.items():
            print(f"  {strategy:18s} each step: {launches['step']}; logs: {launches['logs']}")


if __name__ == "__main__":
    main()
