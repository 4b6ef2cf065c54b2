"""What kt.Trainer's Python loop costs against fit, side by side in one process.

    python benchmarks/trainer_overhead.py [--batch 64] [--steps 40] [--rounds 8]

The same single-cost step on 2 towers, run two ways:
  fit:     TowerModel.fit (the loop of steps is compiled, callbacks per step);
  trainer: a kt.Trainer whose run_step() takes the towers' batches and calls
           a @tower_function doing the same forward, backward and update,
           through the hooked path: one Python iteration per step.
Prints samples/s of each and (c) = trainer / fit, of wall-clock samples/s
and of samples per CPU-second, medians of ratios taken within each round.
Uses the model and helpers of benchmarks/overhead.py.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from overhead import batch_of  # noqa: E402
from overhead import compile_model  # noqa: E402
from overhead import convnet  # noqa: E402
from overhead import devices  # noqa: E402
from overhead import timed  # noqa: E402
from overhead import tower_fit_runner  # noqa: E402


def trainer_runner(devs, batch):
    import tensorflow as tf

    import kerastower as kt

    class OneCostTrainer(kt.Trainer):
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

    with kt.distributed("mirrored", devices=devs):
        model = compile_model(convnet(kt.TowerModel))
        model.optimizer.build(model.trainable_variables)
        model._symbolic_build(data_batch=tuple(tf.TensorSpec((None,) + t.shape[1:], t.dtype) for t in batch))
    trainer = OneCostTrainer(model, kt.DummyConstantInput(batch))

    def run(steps):
        trainer.train(steps_per_epoch=steps, max_epoch=trainer.epoch_num + 1,
                      starting_epoch=trainer.epoch_num + 1, verbose=0)

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="per-tower batch")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    devs, where = devices()
    batch = batch_of(args.batch)
    runners = {
        "TowerModel.fit, 2 towers": tower_fit_runner("mirrored", devs, batch),
        "kt.Trainer run_step, 2 towers": trainer_runner(devs, batch),
    }
    samples = 2 * args.batch * args.steps
    rates = {name: [] for name in runners}
    ratios = {"wall": [], "cpu": []}
    for _ in range(args.rounds):
        wall, cpu = {}, {}
        for name, run in runners.items():
            seconds, cpu_seconds = timed(run, args.steps)
            wall[name], cpu[name] = samples / seconds, samples / cpu_seconds
            rates[name].append(wall[name])
        fit_name, trainer_name = runners
        ratios["wall"].append(wall[trainer_name] / wall[fit_name])
        ratios["cpu"].append(cpu[trainer_name] / cpu[fit_name])
    print(f"devices: {where}; per-tower batch {args.batch}; "
          f"{args.steps} steps x {args.rounds} rounds (medians)")
    for name, r in rates.items():
        print(f"  {name:32s} {statistics.median(r):10.1f} samples/s")
    print(f"(c) kt.Trainer / TowerModel.fit          wall {statistics.median(ratios['wall']):.3f}   "
          f"CPU time {statistics.median(ratios['cpu']):.3f}")


if __name__ == "__main__":
    main()
