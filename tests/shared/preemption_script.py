"""Trains with AutoResume + ModelSaver as a process a test can signal and restart.

    python preemption_script.py CKPT_DIR OUT.npz [--towers N] [--batch B]
        [--epochs E] [--marks DIR] [--pause-at K] [--signal-during-save] [--dropout]

Runs on the backend KERAS_BACKEND names, with N towers (logical CPU devices
on TensorFlow, forced host devices on JAX) on shuffled numpy arrays, each
epoch one pass. --marks writes a file `step-<global step>` there after
every step, and --pause-at K waits after global step K until a file `go`
appears there, so that a test can signal (or start another run) at that
step; --signal-during-save makes the process send
itself a second SIGTERM while its preemption checkpoint is being written;
--hang-at K makes the step after global step K hang for 10 minutes inside
the compiled step (a tf.py_function or a jax.pure_callback that sleeps, so
the main thread waits in C++ code, where Python runs no signal handler) and
leaves a file `hanging` in --marks once it sleeps; --grace S is
AutoResume's step_grace_s;
--backup adds Keras's BackupAndRestore (epoch-end backups) beside AutoResume;
--stateful validates every epoch (on labels unlike the training ones, so
that the validation loss soon rises) with EarlyStopping(restore_best_weights),
ReduceLROnPlateau and ModelCheckpoint(save_best_only), and also saves their
state (best epoch, stopped epoch, learning rate).
Without --dropout the model is deterministic across tower counts (Dense
layers only), which the elastic-resume tests need.
"""

import argparse
import os
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ARGS = argparse.ArgumentParser()
ARGS.add_argument("ckpt")
ARGS.add_argument("out")
ARGS.add_argument("--towers", type=int, default=2)
ARGS.add_argument("--batch", type=int, default=4)
ARGS.add_argument("--epochs", type=int, default=3)
ARGS.add_argument("--marks")
ARGS.add_argument("--pause-at", type=int, help="wait after this global step for MARKS/go")
ARGS.add_argument("--signal-during-save", action="store_true")
ARGS.add_argument("--dropout", action="store_true")
ARGS.add_argument("--strict", action="store_true")
ARGS.add_argument("--save-every", type=int, default=0)
ARGS.add_argument("--hang-at", type=int, help="hang the step after this global step")
ARGS.add_argument("--grace", type=float, help="AutoResume's step_grace_s")
ARGS.add_argument("--backup", action="store_true", help="add keras.callbacks.BackupAndRestore")
ARGS.add_argument("--stateful", action="store_true",
                  help="validate, with EarlyStopping, ReduceLROnPlateau, ModelCheckpoint")
OPTIONS = ARGS.parse_args()

if os.environ.get("KERAS_BACKEND") == "jax":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={OPTIONS.towers}")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerastower as kt  # noqa: E402


def devices(n):
    if keras.backend.backend() == "jax":
        import jax

        return jax.devices()[:n]
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    tf.config.experimental.enable_op_determinism()
    return [f"/cpu:{i}" for i in range(n)]


HANG = [False]  # set before the step that hangs


def _maybe_hang(*_):
    if HANG[0]:
        HANG[0] = False  # one tower hangs; that is enough
        open(os.path.join(OPTIONS.marks, "hanging"), "w").close()
        time.sleep(600)
    return np.float32(0.0)


class Hang(keras.layers.Layer):
    """Hangs the step (in C++ code's callback thread) once HANG is set."""

    def call(self, x):
        if keras.backend.backend() == "jax":
            import jax

            # Its result is used: the step's outputs wait for it.
            waited = jax.pure_callback(_maybe_hang, jax.ShapeDtypeStruct((), "float32"))
            return x + jax.lax.stop_gradient(waited)
        import tensorflow as tf

        waited = tf.reshape(tf.py_function(_maybe_hang, [], tf.float32), [])
        return x + tf.stop_gradient(waited)


class Marks(keras.callbacks.Callback):
    """Leaves a file saying which step ended; waits at --pause-at for the test."""

    def on_train_batch_begin(self, batch, logs=None):
        if OPTIONS.hang_at is not None and self.model.loop.global_step == OPTIONS.hang_at:
            HANG[0] = True

    def on_train_batch_end(self, batch, logs=None):
        if OPTIONS.marks:
            step = self.model.loop.global_step
            open(os.path.join(OPTIONS.marks, f"step-{step}"), "w").close()
            if step == OPTIONS.pause_at:
                go, deadline = os.path.join(OPTIONS.marks, "go"), time.time() + 240
                while not os.path.exists(go) and time.time() < deadline:
                    time.sleep(0.02)


def main():
    towers = devices(OPTIONS.towers)
    keras.utils.set_random_seed(7)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 6)).astype("float32")
    y = rng.integers(0, 3, 96).astype("int32")
    if OPTIONS.signal_during_save:
        save = kt.callbacks.AutoResume.save_on_preemption

        def save_with_a_second_signal(self):
            os.kill(os.getpid(), signal.SIGTERM)
            return save(self)

        kt.callbacks.AutoResume.save_on_preemption = save_with_a_second_signal
    with kt.distributed("mirrored", devices=towers):
        inputs = keras.Input((6,))
        h = keras.layers.Dense(16, activation="relu")(inputs)
        if OPTIONS.dropout:
            h = keras.layers.Dropout(0.25)(h)
        if OPTIONS.hang_at is not None:
            h = Hang()(h)
        model = kt.TowerModel(inputs, keras.layers.Dense(3)(h))
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    grace = {} if OPTIONS.grace is None else {"step_grace_s": OPTIONS.grace}
    resume = kt.callbacks.AutoResume(OPTIONS.ckpt, strict=OPTIONS.strict, **grace)
    saver = kt.callbacks.ModelSaver(OPTIONS.ckpt)
    if OPTIONS.save_every:
        saver = kt.callbacks.PeriodicTrigger(saver, every_k_steps=OPTIONS.save_every)
    backup = [keras.callbacks.BackupAndRestore(OPTIONS.ckpt + "-backup")] if OPTIONS.backup else []
    stateful, validation, outcome = [], None, {}
    if OPTIONS.stateful:
        # Half seen in training, half not: the validation loss falls, then rises.
        validation = (np.concatenate([x[:12], rng.normal(size=(12, 6)).astype("float32")]),
                      np.concatenate([y[:12], rng.integers(0, 3, 12).astype("int32")]))
        stateful = [
            keras.callbacks.EarlyStopping(patience=2, restore_best_weights=True),
            keras.callbacks.ReduceLROnPlateau(patience=1, factor=0.5),
            keras.callbacks.ModelCheckpoint(OPTIONS.ckpt + "-best.keras", save_best_only=True),
        ]
    model.fit(x, y, batch_size=OPTIONS.batch, epochs=OPTIONS.epochs, shuffle=True, verbose=2,
              validation_data=validation, callbacks=[*backup, resume, saver, *stateful, Marks()])
    print("resumed from", resume.restored_from, flush=True)
    if OPTIONS.stateful:
        early, plateau, best = stateful
        outcome = dict(best_epoch=early.best_epoch, stopped_epoch=early.stopped_epoch,
                       early_best=early.best, plateau=(plateau.wait, plateau.best),
                       checkpoint_best=best.best,
                       learning_rate=np.asarray(model.optimizer.learning_rate))
    np.savez(OPTIONS.out, *model.get_weights(), step=np.asarray(model.optimizer.iterations),
             **outcome)


if __name__ == "__main__":
    main()
