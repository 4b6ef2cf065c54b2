"""Trains under kt.distributed("multihost"); run by test_jax_multihost as one of 2 processes.

    JAX_COORDINATOR_ADDRESS=localhost:PORT JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=I \\
    KERAS_BACKEND=jax XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
        python multihost_script.py OUT.npz CKPT_DIR [--resume]

Each process seeds its model and its data order differently: what it ends
with is the chief's start, trained on every process's towers. The cases'
models and data are also what the test's one-device reference uses.
With --resume, AutoResume takes the chief's newest checkpoint and fit goes
on to epoch 3: every process ends where one run of 3 epochs would.
"""

import os
import signal
import sys

import keras
import numpy as np

import kerastower as kt

BATCH = 4  # per tower; 4 towers in all: 16 examples a step


def data(n=60):
    """60 examples: 3 whole steps of 4 towers, then a short one of 12."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 2))).astype("float32")
    weight = rng.uniform(0.5, 2.0, n).astype("float32")
    return x, y, weight


def batchnorm_model():
    inputs = keras.Input((5,))
    h = keras.layers.Dense(8, use_bias=False)(inputs)  # BN takes out a bias: its gradient is noise
    h = keras.layers.BatchNormalization(synchronized=True)(h)
    h = keras.layers.Activation("relu")(h)
    model = kt.TowerModel(inputs, keras.layers.Dense(2)(h))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"],
                  weighted_metrics=["mse"])
    return model


def train(model, seed, callbacks=(), epochs=2):
    """`epochs` of the shuffled data, with sample weights; then evaluate and
    predict. `seed` draws the data order (the chief's is used everywhere)."""
    x, y, weight = data()
    np.random.seed(seed)
    history = model.fit(x, y, sample_weight=weight, batch_size=BATCH, epochs=epochs, shuffle=True,
                        verbose=0, callbacks=list(callbacks))
    evaluated = model.evaluate(x[:50], y[:50], batch_size=BATCH, verbose=0, return_dict=True)
    predicted = model.predict(x[:50], batch_size=BATCH, verbose=0)
    return history.history, evaluated, predicted


def results(model, history, evaluated, predicted):
    out = {f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
    out.update({f"history_{k}": np.asarray(v) for k, v in history.items()})
    out.update({f"evaluate_{k}": np.asarray(v) for k, v in evaluated.items()})
    out["predicted"] = predicted
    out["global_step"] = np.asarray(model.loop.global_step)
    return out


class SignalProcess1(keras.callbacks.Callback):
    """Process 1 alone sends itself SIGTERM after global step 5 (epoch 2, step 1)."""

    def __init__(self, process):
        super().__init__()
        self.process = process

    def on_train_batch_end(self, batch, logs=None):
        # Every process reads self.model (on JAX that syncs the weights, a
        # collective on several processes), then only process 1 signals.
        if self.model.loop.global_step == 5 and self.process == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def main(out, ckpt_dir, resume, preempt):
    process = int(os.environ["JAX_PROCESS_ID"])
    with kt.distributed("multihost") as strategy:
        keras.utils.set_random_seed(1234 + process)  # only the chief's weights may count
        model = batchnorm_model()
    assert strategy.num_towers == 4 and len(strategy.local_devices) == 2, strategy
    callbacks = [kt.callbacks.ModelSaver(ckpt_dir)]
    if resume or preempt:
        callbacks.insert(0, kt.callbacks.AutoResume(ckpt_dir))
    if preempt:
        callbacks.append(SignalProcess1(process))
        try:
            train(model, seed=process, callbacks=callbacks, epochs=3)
        except kt.Preempted as stop:
            np.savez(out, code=stop.code, step=stop.global_step, checkpoint=str(stop.checkpoint),
                     signal=str(stop.signal_name))
            raise
        raise AssertionError("the run was not preempted")
    found = results(model, *train(model, seed=process, callbacks=callbacks,
                                  epochs=3 if resume else 2))
    found["is_chief"] = np.asarray(strategy.is_chief)
    np.savez(out, **found)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--resume" in sys.argv, "--preempt" in sys.argv)
