"""One worker of a 2-worker MultiWorkerMirroredStrategy cluster on loopback;
run by test_multiworker with TF_CONFIG set.

    python multiworker_script.py OUT_DIR
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import kerastower as kt  # noqa: E402

switch = kt.distributed("multiworker")  # first, before any other TF op
strategy = switch.__enter__()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests.tensorflow import horovod_script as shared  # noqa: E402  (the same data and model)


def main(out):
    worker = strategy.worker_index
    model = shared.build()
    if worker == 1:
        model.set_weights([w + 1.0 for w in model.get_weights()])
    history = model.fit(shared.endless(), steps_per_epoch=3, epochs=2, verbose=0,
                        logdir=os.path.join(out, f"logs_worker{worker}"))
    np.savez(os.path.join(out, f"weights_worker{worker}.npz"), *model.get_weights())
    x, y = shared.data()
    result = {
        "towers": model.num_towers,
        "history": history.history,
        "collectives": kt.collectives_per_step(model),
        "collective_ops": {op: n for op, n in kt._compat.op_counts(model.train_function).items()
                           if op.startswith("Collective")},
        "variables": [len(model.trainable_variables), sum(len(m.variables) for m in model.metrics)],
        "evaluate": model.evaluate(x, y, batch_size=5, verbose=0, return_dict=True),
        "predict_rows": int(model.predict(x, batch_size=5, verbose=0).shape[0]),
        "nonfinite": shared.fit_with_a_nan_on_rank_1(worker),
        # keras.io's CycleGAN: its four optimizers build on first use, and
        # every worker builds them before the chief restores a checkpoint.
        "first_use_resume_equal": shared.optimizers_built_on_first_use_resume(out),
        "seeded_shuffle": shared.seeded_shuffle_fit(worker),
    }
    with open(os.path.join(out, f"results_worker{worker}.json"), "w") as f:
        json.dump(result, f)
    switch.__exit__(None, None, None)


def die(out):
    """Worker 1 dies at step 3; worker 0 must fail with a clear error."""

    class Die(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if strategy.worker_index == 1 and batch == 2:
                os._exit(3)

    shared.build().fit(shared.endless(), steps_per_epoch=1000, verbose=0, callbacks=[Die()])


def preempt(out):
    shared.preempted_run(out, strategy.worker_index, sys.argv[2])


if __name__ == "__main__":
    if sys.argv[2:] in (["preempt"], ["resume"]):
        preempt(sys.argv[1])
    else:
        (die if sys.argv[2:] == ["die"] else main)(sys.argv[1])
