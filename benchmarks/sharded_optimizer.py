"""Sharded optimizer state on JAX: its step time against the replicated step, and its bytes per device.

    KERAS_BACKEND=jax python benchmarks/sharded_optimizer.py [--towers 2,4] [--model mlp]
        [--batch 32] [--steps 20] [--rounds 5]

The same model (models.py: `mlp`, 784-1024-1024-10, 1.9 M weights; Adam)
is trained on N towers with each tower holding the whole optimizer state
and with `kt.distributed("mirrored", shard_optimizer=True)`, fits
alternating in one process (harness.py); printed per N: the optimizer
state each device holds (`kt.optimizer_state_bytes`, read from the
devices' buffers) and the median of the rounds' speed ratios (sharded /
replicated). On a CPU the towers are forced host devices sharing its
cores: the all-gather and reduce-scatter are memory copies there, so the
ratio shows what the extra collectives and the cut-and-gather of the
weights cost, not what an interconnect would.
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import models  # noqa: E402

import kerastower as kt  # noqa: E402


def _model(build, towers, shard):
    import keras

    keras.utils.set_random_seed(0)
    with kt.distributed("mirrored", devices=list(range(towers)), shard_optimizer=shard):
        model = build(kt.TowerModel)
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--towers", default="2,4")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--batch", type=int, default=32, help="examples a tower takes a step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    counts = [int(n) for n in args.towers.split(",")]
    kt.use_cpu_towers(max(counts))   # before JAX starts; where there are GPUs, the towers are those
    import jax
    import numpy as np

    build = getattr(models, args.model)
    print(f"{args.model}, Adam, {args.batch} examples a tower, {jax.devices()[0].device_kind} "
          f"({jax.devices()[0].platform}), JAX {jax.__version__}")
    for towers in counts:
        batch = args.batch * towers
        rows = (harness.WARMUP + args.steps) * batch
        rng = np.random.default_rng(0)
        x = rng.normal(size=(rows,) + tuple(build(kt.TowerModel).input_shape[1:])).astype("float32")
        y = rng.integers(0, 10, rows).astype("int32")
        fitted = {}
        runners = {}
        for name, shard in (("replicated", False), ("sharded", True)):
            model = fitted[name] = _model(build, towers, shard)
            runners[name] = (harness.fit_runner(lambda steps, callbacks, model=model: model.fit(
                x, y, batch_size=args.batch, steps_per_epoch=steps, epochs=1, verbose=0,
                callbacks=callbacks)), batch)
        result = harness.compare(runners, args.steps, args.rounds)
        held = {name: kt.optimizer_state_bytes(model) for name, model in fitted.items()}
        print(f"{towers} towers: optimizer state a device holds, replicated "
              f"{max(held['replicated'].values()) / 2**20:.2f} MiB, sharded "
              f"{max(held['sharded'].values()) / 2**20:.2f} MiB "
              f"({max(held['sharded'].values()) / max(held['replicated'].values()):.3f}); "
              f"speed sharded / replicated, median of {args.rounds} rounds: "
              f"{result.ratio('sharded', 'replicated'):.3f} "
              f"(replicated {1000 * batch / result.rate('replicated'):.2f} ms a step, sharded "
              f"{1000 * batch / result.rate('sharded'):.2f})")


if __name__ == "__main__":
    main()
