"""One Horovod rank of `benchmarks/run.py`'s Horovod comparison.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/horovod_rate.py OUT.json BATCH STEPS

Each rank trains the same model as the mirrored run, one tower per rank;
rank 0 writes the samples/s of all ranks together and the collectives a
step launches.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import kerastower as kt  # noqa: E402

import cases  # noqa: E402
import models  # noqa: E402


def main(out, batch, steps):
    rate, model = cases.measured_rate(models.convnet, "horovod", None, batch, steps)
    if model.tower_strategy.is_chief:
        with open(out, "w") as f:
            json.dump({"rate": rate, "collectives": kt.collectives_per_step(model)}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
