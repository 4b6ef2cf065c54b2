"""Trains with AutoResume + ModelSaver; run by test_checkpoints as a process.

    python resume_script.py CKPT_DIR OUT.npz [--slow]

--slow sleeps after every step so that the test can kill it mid-epoch.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)
tf.config.experimental.enable_op_determinism()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests.helpers.loop_cases import resumable_run  # noqa: E402


def main(ckpt_dir, out, slow):
    keras.utils.set_random_seed(7)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 6)).astype("float32")
    y = rng.integers(0, 3, 60).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(60, seed=3).batch(4).repeat()

    model, callbacks, resume = resumable_run(ckpt_dir, slow, ["/cpu:0", "/cpu:1"], 0.4)
    model.fit(dataset, steps_per_epoch=5, epochs=4, verbose=0, callbacks=callbacks)
    print("resumed from", resume.restored_from, flush=True)
    np.savez(out, *model.get_weights(), step=model.optimizer.iterations.numpy())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--slow" in sys.argv)
