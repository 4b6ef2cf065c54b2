"""The same seed gives the same run on TensorFlow and on JAX, and a
checkpoint written on one resumes on the other.

Which rows of numpy arrays each tower takes, and in which order every pass
reads them, is decided once for both backends (kerastower/inputs/array_rows.py):
a script trained with shuffled arrays on TensorFlow and then on JAX (as
after a backend switch) sees the same batches and ends at the same weights.
Checkpoints hold `variables.npz` on both backends, and integer variables
whose dtype differs between them (the optimizer's step counter, random
streams' states) are restored with a cast (kerastower/checkpoint/__init__.py).
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerastower as kt
from kerastower.checkpoint import files as checkpoint_files

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "backend_switch_script.py")
CHECKPOINT_SCRIPT = os.path.join(HERE, "checkpoint_switch_script.py")


def _env(backend):
    return dict(os.environ, KERAS_BACKEND=backend,
                XLA_FLAGS="--xla_force_host_platform_device_count=2")


def _last_json_line(args, backend):
    done = subprocess.run([sys.executable, *args], env=_env(backend), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run(backend, epochs):
    return _last_json_line([SCRIPT, str(epochs)], backend)


def test_shuffled_arrays_train_alike_on_tensorflow_and_jax():
    tf_run, jax_run = _run("tensorflow", 3), _run("jax", 3)
    np.testing.assert_allclose(tf_run["loss"], jax_run["loss"], rtol=1e-5, atol=1e-6)
    for tf_weight, jax_weight in zip(tf_run["weights"], jax_run["weights"]):
        np.testing.assert_allclose(tf_weight, jax_weight, rtol=1e-5, atol=1e-6)


# -- a checkpoint written on one backend resumes on the other --------------------------

STEPS_PER_EPOCH = 5  # checkpoint_switch_script.py: 40 rows, 4 per tower, 2 towers


def _phases(backend, phases, refuse_tensorflow=False, keras_seed=False):
    """checkpoint_switch_script.py's results for `phases` [(epochs, ckpt dir or None)]."""
    args = [CHECKPOINT_SCRIPT, json.dumps(phases)]
    args += ["--refuse-tensorflow"] * refuse_tensorflow + ["--keras-seed"] * keras_seed
    return _last_json_line(args, backend)


def _assert_resumed_like(resumed, whole, backend):
    assert resumed["restored_from"] == f"ckpt-{2 * STEPS_PER_EPOCH:08d}"
    assert resumed["epochs_begun"] == [2, 3]  # it went on at epoch 3
    assert resumed["iterations"] == resumed["global_step"] == 4 * STEPS_PER_EPOCH
    counter = "int64" if backend == "tensorflow" else "int32"
    state = "int64" if backend == "tensorflow" else "uint32"
    assert resumed["integer_dtypes"] == {"optimizer/adam/iteration": counter,
                                         "model/jitter/seed_generator_state": state}
    assert resumed["seed_state"] == whole["seed_state"] == [3, 4 * STEPS_PER_EPOCH]
    for got, want in zip(resumed["weights"], whole["weights"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_resumes_on_the_other_backend(tmp_path):
    """2 epochs on one backend with ModelSaver, then the same script for 4
    epochs with AutoResume on the other: epochs 3 and 4 only, ending where
    an uninterrupted 4-epoch run ends. Both ways; the JAX run reads
    TensorFlow's checkpoint where TensorFlow cannot be imported."""
    jax_written, tf_written = str(tmp_path / "jax-ckpt"), str(tmp_path / "tf-ckpt")
    # One process per backend and phase group: JAX writes, TensorFlow
    # resumes it and writes, JAX resumes that.
    whole, jax_first = _phases("jax", [(4, None), (2, jax_written)])
    tf_resumed, tf_first = _phases("tensorflow", [(4, jax_written), (2, tf_written)])
    (jax_resumed,) = _phases("jax", [(4, tf_written)], refuse_tensorflow=True)

    for first in (jax_first, tf_first):
        assert first["restored_from"] is None and first["epochs_begun"] == [0, 1]
        assert first["iterations"] == 2 * STEPS_PER_EPOCH
    newest = os.path.join(tf_written, f"ckpt-{2 * STEPS_PER_EPOCH:08d}")
    assert sorted(os.listdir(newest)) == ["manifest.json", "state.json", "variables.npz"]
    saved = {v["key"]: v["dtype"] for v in kt.checkpoint.verify_checkpoint(newest)["variables"]}
    assert saved["optimizer/adam/iteration"] == "int64"  # TensorFlow's counter, resumed on JAX
    # The 2 epochs taken must matter: the comparison below can fail.
    assert not np.allclose(whole["weights"][0], jax_first["weights"][0], rtol=1e-3)

    _assert_resumed_like(tf_resumed, whole, "tensorflow")
    _assert_resumed_like(jax_resumed, whole, "jax")
    assert not jax_resumed["tensorflow_imported"]


def test_a_resume_on_the_other_backend_says_when_the_shuffled_order_changes(tmp_path):
    """With keras.utils.set_random_seed, each backend reads shuffled arrays
    in its stock Keras's order; those differ, so a TensorFlow checkpoint
    resumed on JAX cannot take the examples the uninterrupted run would,
    and the resume says so (nothing silent). On the same backend it resumes
    without a word."""
    written = str(tmp_path / "tf-ckpt")
    (first,) = _phases("tensorflow", [(2, written)], keras_seed=True)
    (same,) = _phases("tensorflow", [(3, written)], keras_seed=True)
    (other,) = _phases("jax", [(4, written)], keras_seed=True)
    assert first["warnings"] == [] and same["warnings"] == []
    assert same["restored_from"] == f"ckpt-{2 * STEPS_PER_EPOCH:08d}"
    assert other["restored_from"] == f"ckpt-{3 * STEPS_PER_EPOCH:08d}"
    assert len(other["warnings"]) == 1, other["warnings"]
    assert "'keras-tensorflow' order" in other["warnings"][0]
    assert "'keras-jax' order" in other["warnings"][0]


# -- integer dtypes, in process --------------------------------------------------------

class Counter(keras.layers.Layer):
    """An identity layer holding an integer counter of the dtype given."""

    def __init__(self, counter_dtype, **kwargs):
        super().__init__(**kwargs)
        self.count = self.add_weight(shape=(), dtype=counter_dtype, initializer="zeros",
                                     trainable=False, name="count")

    def call(self, x):
        return x


def _counter_model(counter_dtype, kernel_dtype="float32"):
    inputs = keras.Input((3,))
    h = Counter(counter_dtype, name="counter")(inputs)
    return kt.TowerModel(inputs, keras.layers.Dense(1, name="dense", dtype=kernel_dtype)(h))


def _written(directory, counter_dtype, count, step=1):
    model = _counter_model(counter_dtype)
    model.get_layer("counter").count.assign(count)
    state = {"global_step": step, "epoch_num": 1, "local_step": step}
    return kt.checkpoint.write_checkpoint(directory, model, state), model


def test_an_int64_counter_restores_into_an_int32_one(tmp_path):
    path, saved = _written(str(tmp_path), "int64", 41)
    manifest = kt.checkpoint.verify_checkpoint(path)
    assert {v["key"]: v["dtype"] for v in manifest["variables"]}["model/counter/count"] == "int64"
    model = _counter_model("int32")
    kt.checkpoint.read_checkpoint(path, model)
    count = model.get_layer("counter").count
    assert count.dtype == "int32" and int(count.numpy()) == 41
    np.testing.assert_array_equal(model.get_layer("dense").kernel.numpy(),
                                  saved.get_layer("dense").kernel.numpy())
    # uint32 (a JAX random stream's state) and int64 both ways
    path, _ = _written(str(tmp_path), "uint32", 2**32 - 1, step=2)
    wide = _counter_model("int64")
    kt.checkpoint.read_checkpoint(path, wide)
    assert int(wide.get_layer("counter").count.numpy()) == 2**32 - 1


@pytest.mark.parametrize("saved_dtype, value, model_dtype", [
    ("int64", 2**31, "int32"), ("int64", -1, "uint32"), ("int32", -(2**31), "uint8")])
def test_an_integer_out_of_the_models_range_is_refused_naming_it(tmp_path, saved_dtype, value,
                                                                  model_dtype):
    path, _ = _written(str(tmp_path), saved_dtype, value)
    model = _counter_model(model_dtype)
    with pytest.raises(kt.checkpoint.CheckpointMismatchError) as error:
        kt.checkpoint.read_checkpoint(path, model)
    message = str(error.value)
    for part in ("model/counter/count", saved_dtype, model_dtype, str(value)):
        assert part in message, message
    assert error.value.out_of_range == [("model/counter/count", saved_dtype, model_dtype, value)]
    assert int(model.get_layer("counter").count.numpy()) == 0  # nothing restored
    # allow_partial restores the rest and keeps the counter as it is
    kernel = model.get_layer("dense").kernel
    kernel.assign(np.zeros(kernel.shape))
    with pytest.warns(UserWarning, match="model/counter/count"):
        kt.checkpoint.read_checkpoint(path, model, allow_partial=True)
    assert int(model.get_layer("counter").count.numpy()) == 0
    assert np.any(kernel.numpy() != 0)


def test_float_dtypes_must_still_match_exactly(tmp_path):
    path, _ = _written(str(tmp_path), "int64", 1)
    with pytest.raises(kt.checkpoint.CheckpointMismatchError) as error:
        kt.checkpoint.read_checkpoint(path, _counter_model("int64", kernel_dtype="float16"))
    assert error.value.reshaped == [("model/dense/kernel", "(3, 1) float32", "(3, 1) float16"),
                                    ("model/dense/bias", "(1,) float32", "(1,) float16")]
    with pytest.raises(kt.checkpoint.CheckpointMismatchError, match="model/counter/count"):
        kt.checkpoint.read_checkpoint(path, _counter_model("float32"))  # int to float: no


def test_bfloat16_variables_round_trip_through_the_npz_file(tmp_path):
    # numpy stores dtypes it does not know (bfloat16) as raw bytes; the
    # manifest's dtype gives them back theirs.
    inputs = keras.Input((3,))
    model = kt.TowerModel(inputs, keras.layers.Dense(2, dtype="bfloat16", name="dense")(inputs))
    kernel = model.get_layer("dense").kernel
    kernel.assign(np.arange(6).reshape(3, 2) / 4)
    path = kt.checkpoint.write_checkpoint(
        str(tmp_path), model, {"global_step": 1, "epoch_num": 1, "local_step": 1})
    saved = kernel.numpy()
    kernel.assign(np.zeros((3, 2)))
    kt.checkpoint.read_checkpoint(path, model)
    assert kernel.dtype == "bfloat16"
    np.testing.assert_array_equal(kernel.numpy(), saved)
    assert np.any(saved != 0)


# -- checkpoints older kerastower versions wrote on TensorFlow ------------------------

def _old_tensorflow_format(directory, step):
    """A checkpoint of `step` as kerastower wrote them on TensorFlow before
    variables.npz: variables.index and variables.data-* by SaveV2."""
    path, model = _written(directory, "int64", 5, step=step)
    manifest = kt.checkpoint.verify_checkpoint(path)
    with np.load(os.path.join(path, "variables.npz")) as stored:
        values = {key: stored[key] for key in stored.files}

    def fill(folder):
        tf.raw_ops.SaveV2(prefix=os.path.join(folder, "variables"), tensor_names=list(values),
                          shape_and_slices=[""] * len(values), tensors=list(values.values()))
        with open(os.path.join(folder, "state.json"), "w") as f:
            json.dump({"global_step": step, "epoch_num": 1, "local_step": step}, f)

    fields = {"variables": manifest["variables"], "retention": {}}
    return checkpoint_files.commit(directory, step, fill, fields), model


def test_the_old_tensorflow_format_is_read_and_without_tensorflow_says_so(tmp_path, monkeypatch):
    path, saved = _old_tensorflow_format(str(tmp_path / "old"), 3)
    assert "variables.index" in os.listdir(path) and "variables.npz" not in os.listdir(path)
    model = _counter_model("int32")
    assert kt.checkpoint.read_checkpoint(path, model)["global_step"] == 3
    assert int(model.get_layer("counter").count.numpy()) == 5
    np.testing.assert_array_equal(model.get_layer("dense").kernel.numpy(),
                                  saved.get_layer("dense").kernel.numpy())
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # importing it now fails
    with pytest.raises(kt.KerasTowerError, match="TensorFlow's format.*older kerastower") as error:
        kt.checkpoint.read_checkpoint(path, model)
    assert path in str(error.value) and "Install TensorFlow" in str(error.value)
    assert not isinstance(error.value, kt.checkpoint.DamagedCheckpointError)
