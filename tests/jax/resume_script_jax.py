"""Trains on JAX with AutoResume + ModelSaver; run by test_jax_resume as a process.

    KERAS_BACKEND=jax python resume_script_jax.py CKPT_DIR OUT.npz [--slow]

--slow sleeps after every step so that the test can kill it mid-epoch.
Importing TensorFlow is refused: checkpoints on JAX must not need it.
"""

import sys


class RefuseTensorFlow:
    """Fails any import of TensorFlow (or TensorBoard, or Horovod)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("tensorflow", "tensorboard", "horovod"):
            raise ImportError(f"this script forbids importing {name}")


sys.meta_path.insert(0, RefuseTensorFlow())

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import kerastower as kt  # noqa: E402

from tests.helpers.loop_cases import resumable_run  # noqa: E402


def main(ckpt_dir, out, slow):
    keras.utils.set_random_seed(7)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 6)).astype("float32")
    y = rng.integers(0, 3, 60).astype("int32")

    model, callbacks, resume = resumable_run(ckpt_dir, slow, jax.devices()[:2], 0.3)
    # 60 examples, 2 towers x 4: 8 steps a pass (the last one short), shuffled.
    model.fit(x, y, batch_size=4, epochs=3, shuffle=True, verbose=0, callbacks=callbacks)
    print("resumed from", resume.restored_from, flush=True)
    print("tensorflow imported:", "tensorflow" in sys.modules, flush=True)
    np.savez(out, *model.get_weights(), step=model.optimizer.iterations.numpy())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--slow" in sys.argv)
