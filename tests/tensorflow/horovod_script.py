"""Runs under `horovodrun -np 2 -H localhost:2 --gloo`; used by test_horovod.

    python horovod_script.py OUT_DIR train    # equivalence, writers, resume, inference
    python horovod_script.py OUT_DIR die      # rank 1 dies mid-training
    python horovod_script.py OUT_DIR preempt  # rank 1 alone gets SIGTERM mid-epoch
    python horovod_script.py OUT_DIR resume   # goes on; compares with an uninterrupted run
"""

import faulthandler
import json
import os
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kerastower as kt  # noqa: E402

from tests.helpers.examples import import_example  # noqa: E402

KMeans = import_example("kmeans_digits").KMeans
MiniBatchKMeansTrainer = import_example("kmeans_digits").MiniBatchKMeansTrainer

B = 8


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 5)).astype("float32")
    y = rng.integers(0, 3, 96).astype("int32")
    return x, y


def build(weights=None):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((5,))
    h = keras.layers.Dense(16, activation="tanh")(inputs)
    model = kt.TowerModel(inputs, keras.layers.Dense(3)(h))
    model.compile(optimizer=keras.optimizers.Adam(0.02, global_clipnorm=0.5), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if weights is not None:
        model.set_weights(weights)
    return model


def endless():
    x, y = data()
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(B).repeat()


def assert_equals_one_process(weights_file, result):
    """The distributed run's weights, logged loss, evaluation and prediction
    equal one process training on the joined batches (2 x B per step)."""
    x, y = data()
    model = build()
    history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(2 * B).repeat(),
                        steps_per_epoch=3, epochs=2, verbose=0)
    saved = np.load(weights_file)
    for key, weight in zip(saved.files, model.get_weights()):
        np.testing.assert_allclose(saved[key], weight, atol=1e-5)
    np.testing.assert_allclose(result["history"]["loss"], history.history["loss"], rtol=1e-5)
    one = model.evaluate(x, y, batch_size=96, verbose=0, return_dict=True)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(result["evaluate"][key], one[key], rtol=1e-5)
    assert result["predict_rows"] == 96


def seeded_shuffle_fit(rank):
    """`fit(x, y)` on arrays shuffled as Keras's default, with Keras's seed
    set to another value on every process: all read the order the chief's
    seed gives (stock Keras's on one device). Returns the weights."""
    model = build()
    keras.utils.set_random_seed(11 + rank)
    x, y = data()
    model.fit(x, y, batch_size=B, epochs=2, verbose=0)
    return [w.tolist() for w in model.get_weights()]


def assert_seeded_shuffle_equals_one_process(results):
    """Each process's `seeded_shuffle_fit` equals one device on the joined
    batch, seeded as the chief."""
    model = build()
    keras.utils.set_random_seed(11)
    x, y = data()
    model.fit(x, y, batch_size=2 * B, epochs=2, verbose=0)
    for result in results:
        for got, want in zip(result["seeded_shuffle"], model.get_weights()):
            np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


class NoiseFromInput(kt.GANModel):
    """Noise comes with the input, (real, noise): every run sees the same."""

    def real_samples(self, data):
        return data[0]

    def sample_noise(self, data):
        return data[1]


def build_gan():
    keras.utils.set_random_seed(7)
    generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(3)])
    discriminator = keras.Sequential([keras.Input((3,)), keras.layers.Dense(8, activation="relu"),
                                      keras.layers.Dense(1)])
    gan = NoiseFromInput(generator, discriminator)
    gan.compile(g_optimizer=keras.optimizers.Adam(1e-2), d_optimizer=keras.optimizers.Adam(1e-2))
    return gan


def trainer_data(batch):
    rng = np.random.default_rng(1)
    real = rng.normal(2.0, 0.5, (128, 3)).astype("float32")
    noise = rng.normal(0.0, 1.0, (128, 4)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((real, noise)).batch(batch).repeat()


def run_trainers(batch):
    """A GAN and a k-means trained by kt.Trainer subclasses; their weights."""
    gan = build_gan()
    kt.GANTrainer(gan, trainer_data(batch)).train(steps_per_epoch=4, max_epoch=2, verbose=0)
    points = trainer_data(batch).map(lambda real, noise: real)
    kmeans = KMeans(np.array([[1.0, 1.0, 1.0], [3.0, 3.0, 3.0]], "float32"))
    MiniBatchKMeansTrainer(kmeans, points).train(steps_per_epoch=4, max_epoch=2, verbose=0)
    return [w.numpy() for w in gan.generator.weights + gan.discriminator.weights] + [
        kmeans.centroids.numpy(), kmeans.counts.numpy()]


def assert_trainers_equal_one_process(weights_file):
    saved = np.load(weights_file)
    for key, weight in zip(saved.files, run_trainers(2 * B)):
        np.testing.assert_allclose(saved[key], weight, atol=1e-5)


def optimizers_built_on_first_use_resume(out):
    from tests.tensorflow.keras_io_programs import program_cyclegan

    def run(epochs, callbacks=()):
        keras.utils.set_random_seed(0)
        made = program_cyclegan(kt.TowerModel)
        made.fit(made.model, 4, epochs=epochs, callbacks=list(callbacks))
        return made.model

    folder = os.path.join(out, "ckpt_first_use")
    run(1, [kt.callbacks.ModelSaver(folder)])
    resumed = run(3, [kt.callbacks.AutoResume(folder), kt.callbacks.ModelSaver(folder)])
    straight = run(3)
    optimizers = ("gen_G_optimizer", "gen_F_optimizer", "disc_X_optimizer", "disc_Y_optimizer")
    return all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(resumed.weights, straight.weights)) and all(
        np.array_equal(a.numpy(), b.numpy())
        for name in optimizers
        for a, b in zip(getattr(resumed, name).variables, getattr(straight, name).variables))


def train(out):
    strategy = kt.distributed("horovod")
    with strategy as tower_strategy:
        rank, size = tower_strategy.tower_index(), tower_strategy.num_towers
        results = {"rank": rank, "size": size}

        # 1. Rank 1 starts from other weights; rank 0's are broadcast at fit.
        model = build()
        if rank == 1:
            model.set_weights([w + 1.0 for w in model.get_weights()])
        contexts = []
        probe = keras.callbacks.LambdaCallback(on_train_begin=lambda logs: contexts.append(
            (model.tower_strategy.tower_index(), model.num_towers)))
        history = model.fit(endless(), steps_per_epoch=3, epochs=2, verbose=0, callbacks=[probe])
        results["history"] = history.history
        results["context"] = contexts[0]
        results["collectives"] = kt.collectives_per_step(model)
        results["collective_ops"] = {op: n for op, n in kt._compat.op_counts(model.train_function).items()
                                     if op.startswith("Horovod")}
        results["variables"] = [len(model.trainable_variables),
                                sum(len(m.variables) for m in model.metrics)]
        np.savez(os.path.join(out, f"weights_rank{rank}.npz"), *model.get_weights())
        x, y = data()
        results["evaluate"] = model.evaluate(x, y, batch_size=5, verbose=0, return_dict=True)
        results["collectives_test"] = kt.collectives_per_step(model, "test")
        results["predict_rows"] = int(model.predict(x, batch_size=5, verbose=0).shape[0])

        # 2. Only rank 0 writes logs and checkpoints.
        model = build()
        model.fit(endless(), steps_per_epoch=2, epochs=1, verbose=0,
                  logdir=os.path.join(out, f"logs_rank{rank}"),
                  callbacks=[kt.callbacks.ModelSaver(os.path.join(out, f"ckpt_rank{rank}"))])

        # 3. AutoResume: 2 epochs, then a new model resumes to 4; equals 4 in one go.
        ckpt = os.path.join(out, "ckpt_shared")
        build().fit(endless(), steps_per_epoch=3, epochs=2, verbose=0,
                    callbacks=[kt.callbacks.ModelSaver(ckpt)])
        resumed = build()
        resume = kt.callbacks.AutoResume(ckpt)
        resumed.fit(endless(), steps_per_epoch=3, epochs=4, verbose=0,
                    callbacks=[resume, kt.callbacks.ModelSaver(ckpt)])
        straight = build()
        straight.fit(endless(), steps_per_epoch=3, epochs=4, verbose=0)
        results["resumed_from"] = resume.restored_from
        results["resume_equal"] = all(
            np.array_equal(a, b) for a, b in zip(resumed.get_weights(), straight.get_weights()))
        results["resumed_step"] = int(resumed.optimizer.iterations.numpy())

        # 4. kt.Trainer runs (a GAN, k-means) are data-parallel over ranks too.
        np.savez(os.path.join(out, f"trainer_weights_rank{rank}.npz"), *run_trainers(B))

        # 5. An InferenceRunner runs on every rank, with the same results.
        results["inference"] = fit_with_inference_runner(out, rank)

        # 6. A NaN in rank 1's second batch stops both ranks at step 2.
        results["nonfinite"] = fit_with_a_nan_on_rank_1(rank)

        # 7. keras.io's CycleGAN, base class changed: its four optimizers
        # build on first use, and a resume (the chief reads the checkpoint)
        # ends where an uninterrupted run does.
        results["first_use_resume_equal"] = optimizers_built_on_first_use_resume(out)

        # 8. Shuffled arrays with Keras's seed set (another on each rank) read the chief's order.
        results["seeded_shuffle"] = seeded_shuffle_fit(rank)
    with open(os.path.join(out, f"results_rank{rank}.json"), "w") as f:
        json.dump(results, f)


def fit_with_a_nan_on_rank_1(rank):
    x, y = data()
    if rank == 1:
        x = x.copy()
        x[3 * B + 3, 2] = np.nan  # batch 3: rank 1's batch of step 2
    model = build()
    try:
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(B), epochs=1, verbose=0)
    except kt.errors.KerasTowerError as error:
        return {"error": type(error).__name__, "step": error.global_step, "towers": error.towers,
                "message": str(error), "loop_step": model.loop.global_step,
                "finite": all(bool(np.isfinite(w).all()) for w in model.get_weights())}
    return {"error": None}


def assert_a_nan_stopped_every_process(results):
    """What fit_with_a_nan_on_rank_1 returned on each process: every one
    stopped at step 2, finite, and the one whose tower failed names it."""
    for rank, result in enumerate(results):
        nonfinite = result["nonfinite"]
        assert nonfinite["error"] == "NonFiniteError", nonfinite
        assert (nonfinite["step"], nonfinite["loop_step"], nonfinite["finite"]) == (2, 1, True)
        assert nonfinite["towers"] == ([1] if rank == 1 else [])
    assert "on tower 1 of 2" in results[1]["nonfinite"]["message"]
    assert "another process" in results[0]["nonfinite"]["message"]


def die(out):
    with kt.distributed("horovod") as tower_strategy:
        rank = tower_strategy.tower_index()
        model = build()

        class Die(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if rank == 1 and batch == 2:
                    os._exit(3)

        model.fit(endless(), steps_per_epoch=1000, epochs=1, verbose=0, callbacks=[Die()])


PREEMPTED_AT = 5  # epoch 2, step 2 of 3
# The processes agree whether to stop every few steps and at each epoch's
# end (loop/preemption.py, StopAgreement): they stop together by then.
AGREED_BY = 6


def preempted_run(out, rank, phase):
    """The preemption scenario on 2 processes (Horovod ranks or workers).

    "preempt": 3 epochs of 3 steps with AutoResume and an epoch-end
    ModelSaver; process 1 alone sends itself SIGTERM after global step 5.
    Every process records what `kt.Preempted` said, then exits with it.
    "resume": the same fit again resumes, then an uninterrupted run in
    another folder; records whether their weights are bit-equal."""
    ckpt = os.path.join(out, "ckpt_preempted")
    record = os.path.join(out, f"{phase}_{rank}.json")

    class SignalOneProcess(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if rank == 1 and self.model.loop.global_step == PREEMPTED_AT:
                os.kill(os.getpid(), signal.SIGTERM)

    def fit(folder, *extra):
        model = build()
        resume = kt.callbacks.AutoResume(folder)
        model.fit(endless(), steps_per_epoch=3, epochs=3, verbose=0,
                  callbacks=[resume, kt.callbacks.ModelSaver(folder), *extra])
        return model, resume

    if phase == "preempt":
        try:
            fit(ckpt, SignalOneProcess())
        except kt.Preempted as stop:
            with open(record, "w") as f:
                json.dump({"code": stop.code, "step": stop.global_step,
                           "checkpoint": stop.checkpoint, "signal": stop.signal_name}, f)
            raise
        raise AssertionError("the run was not preempted")
    resumed, resume = fit(ckpt)
    straight, _ = fit(os.path.join(out, f"ckpt_straight_{rank}"))
    with open(record, "w") as f:
        json.dump({
            "resumed_from": resume.restored_from,
            "step": int(resumed.optimizer.iterations.numpy()),
            "bit_equal": all(np.array_equal(a, b) for a, b in
                             zip(resumed.get_weights(), straight.get_weights())),
        }, f)


def assert_preempted_then_resumed_bit_equal(out, launch):
    """`launch(phase)` runs both processes of a phase; checks what each recorded."""
    launch("preempt")
    stops = []
    for rank in (0, 1):
        with open(os.path.join(out, f"preempt_{rank}.json")) as f:
            stops.append(json.load(f))
    assert [s["code"] for s in stops] == [75, 75], stops
    step = stops[0]["step"]
    assert stops[1]["step"] == step and PREEMPTED_AT <= step <= AGREED_BY, stops
    assert [s["signal"] for s in stops] == [None, "SIGTERM"], stops
    # The chief wrote it; every process is told where.
    assert stops[0]["checkpoint"].endswith(f"ckpt-{step:08d}")
    assert stops[1]["checkpoint"] == stops[0]["checkpoint"]
    launch("resume")
    for rank in (0, 1):
        with open(os.path.join(out, f"resume_{rank}.json")) as f:
            resumed = json.load(f)
        assert resumed["step"] == 9 and resumed["bit_equal"], (rank, resumed)
        assert resumed["resumed_from"] == (stops[0]["checkpoint"] if rank == 0 else None)


VALIDATION = 33  # 7 batches of 5: a short last batch on rank 0, an empty one on rank 1


def fit_with_inference_runner(out, rank):
    """fit with an InferenceRunner on every rank: its evaluation and sums are
    collective, so a rank without it would leave the others waiting forever.
    Returns the validation results in the history."""
    x, y = data()
    model = build()
    runner = kt.callbacks.InferenceRunner(
        (x[:VALIDATION], y[:VALIDATION]),
        [kt.callbacks.ScalarStats(["loss", "accuracy"]), kt.callbacks.ClassificationError()],
        batch_size=5)
    faulthandler.dump_traceback_later(120, exit=True)  # a hang fails the job, with tracebacks
    try:
        history = model.fit(endless(), steps_per_epoch=2, epochs=2, verbose=0, callbacks=[runner])
    finally:
        faulthandler.cancel_dump_traceback_later()
    np.savez(os.path.join(out, f"inference_weights_rank{rank}.npz"), *model.get_weights())
    return {key: values for key, values in history.history.items() if key.startswith("val_")}


def assert_inference_equals_one_process(weights_file, inference):
    """The last validation results equal one process evaluating the final
    weights on the whole validation set in one batch."""
    saved = np.load(weights_file)
    model = build([saved[key] for key in saved.files])
    x, y = data()
    one = model.evaluate(x[:VALIDATION], y[:VALIDATION], batch_size=VALIDATION, verbose=0,
                         return_dict=True)
    np.testing.assert_allclose(inference["val_loss"][-1], one["loss"], atol=1e-5)
    np.testing.assert_allclose(inference["val_accuracy"][-1], one["accuracy"], atol=1e-6)
    np.testing.assert_allclose(inference["val_error"][-1], 1 - one["accuracy"], atol=1e-6)


def preempt(out):
    with kt.distributed("horovod") as tower_strategy:
        preempted_run(out, tower_strategy.tower_index(), sys.argv[2])


if __name__ == "__main__":
    {"train": train, "die": die, "preempt": preempt, "resume": preempt}[sys.argv[2]](sys.argv[1])
