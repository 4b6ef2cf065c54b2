"""A tiny training that saves every step; test_faults kills it and restarts it.

    python faults_script.py CKPT_DIR OUT.npz     one run
    python faults_script.py --zygote             one run per stdin line

A run trains 10 epochs of 5 steps on 2 logical CPU towers with AutoResume,
a ModelSaver every step and one at every epoch end (a same-step replace),
and prints, flushed: "resumed from <path or None>" when training begins,
and "saved <global_step>" after each step's save.

FAULT_KILL="<global step>:<save>:<event>" makes the run SIGKILL itself
inside its <save>-th save (1: the step's, 2: the epoch end's replace) at
<global step>, just before the <event>-th file-system event of that save:
numpy's savez (the variables), an fsync, a rename, or an rmtree. The hook lives here
only, not in kerastower.

--zygote pays TensorFlow's import once: for each line "CKPT_DIR OUT.npz
FAULT_KILL-or--" on stdin it forks a fresh process that sets up the devices
and makes one run (nothing of TensorFlow's runtime exists before the fork,
only imported modules), prints "pid <pid>" and, when that process has ended,
"exit <status>" (-9 after a SIGKILL).
"""

import os
import signal
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import shutil  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import kerastower as kt  # noqa: E402

STEPS_PER_EPOCH, EPOCHS = 5, 10


def start_tensorflow():
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
    )
    tf.config.experimental.enable_op_determinism()


def install_kill_hook(spec):
    """Wraps ModelSaver._write (its save, which an epoch-end trigger runs
    once every callback's on_epoch_end has) and the file-system calls a
    save makes, so that the process SIGKILLs itself at the moment `spec`
    names."""
    step, save, event = (int(part) for part in spec.split(":"))
    where = {"saves_at_step": 0, "events": 0, "armed": False}

    def counted(original):
        def call(*args, **kwargs):
            if where["armed"]:
                where["events"] += 1
                if where["events"] == event:
                    os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)
        return call

    for owner, name in ((os, "fsync"), (os, "rename"), (shutil, "rmtree"), (np, "savez")):
        setattr(owner, name, counted(getattr(owner, name)))

    write = kt.callbacks.ModelSaver._write

    def hooked_write(self):
        if self.model.loop.global_step == step:
            where["saves_at_step"] += 1
            where["armed"] = where["saves_at_step"] == save
        try:
            write(self)
        finally:
            where["armed"] = False

    kt.callbacks.ModelSaver._write = hooked_write


class Report(keras.callbacks.Callback):
    def __init__(self, resume):
        super().__init__()
        self.resume = resume

    def on_train_begin(self, logs=None):
        print("resumed from", self.resume.restored_from, flush=True)

    def on_train_batch_end(self, batch, logs=None):
        print("saved", self.model.loop.global_step, flush=True)


def main(ckpt_dir, out):
    keras.utils.set_random_seed(11)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5)).astype("float32")
    y = rng.integers(0, 3, 40).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(40, seed=5).batch(4).repeat()
    with kt.distributed("mirrored", devices=["/cpu:0", "/cpu:1"]):
        inputs = keras.Input((5,))
        h = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
        h = keras.layers.Dropout(0.2, name="drop")(h)
        model = kt.TowerModel(inputs, keras.layers.Dense(3, name="logits")(h))
        model.compile(optimizer=keras.optimizers.Adam(0.02),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        resume = kt.callbacks.AutoResume(ckpt_dir)
        callbacks = [
            resume,
            kt.callbacks.PeriodicTrigger(kt.callbacks.ModelSaver(ckpt_dir, max_to_keep=3), every_k_steps=1),
            Report(resume),
            kt.callbacks.ModelSaver(ckpt_dir, max_to_keep=3),
        ]
        model.fit(dataset, steps_per_epoch=STEPS_PER_EPOCH, epochs=EPOCHS, verbose=0, callbacks=callbacks)
    np.savez(out, *model.get_weights(), step=model.optimizer.iterations.numpy())


def run(ckpt_dir, out, spec):
    if spec:
        install_kill_hook(spec)
    start_tensorflow()
    main(ckpt_dir, out)


def zygote():
    for line in sys.stdin:
        ckpt_dir, out, spec = line.split()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                run(ckpt_dir, out, None if spec == "-" else spec)
            except BaseException:
                traceback.print_exc()
                status = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        print("pid", pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print("exit", os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        zygote()
    else:
        run(sys.argv[1], sys.argv[2], os.environ.get("FAULT_KILL"))
