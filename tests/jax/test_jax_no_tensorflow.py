"""On JAX, kerastower trains without TensorFlow: proven in a process where
importing TensorFlow (or TensorBoard, or Horovod) fails."""

import json
import os
import subprocess
import sys
import textwrap

# Run in a fresh process: this one may have imported TensorFlow already.
SCRIPT = textwrap.dedent('''
    import sys

    class RefuseTensorFlow:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("tensorflow", "tensorboard", "horovod"):
                raise ImportError(f"this test forbids importing {name}")

    sys.meta_path.insert(0, RefuseTensorFlow())

    import json
    import jax, keras, numpy as np
    import kerastower as kt

    logdir = sys.argv[1]
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    with kt.distributed("mirrored", devices=jax.devices()[:2]):
        inputs = keras.Input((4,))
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer="adam", loss="mse", metrics=["mae"])
        callbacks = [
            kt.callbacks.JSONWriter(logdir),
            kt.callbacks.ScheduledHyperParamSetter("learning_rate", [(0, 0.05), (2, 0.01)]),
            kt.callbacks.EstimatedTimeLeft(),
            kt.callbacks.ThroughputTracker(),
            kt.callbacks.PeriodicTrigger(kt.callbacks.ScalarPrinter(), every_k_epochs=2),
        ]
        history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=callbacks)
    # Outside the block too: the model's own strategy, TensorFlow not asked.
    evaluated = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    predicted = model.predict(x, batch_size=16, verbose=0)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    with kt.distributed("mirrored", devices=jax.devices()[:2]):
        gan = kt.GANModel(keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)]),
                          keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
        gan.compile(g_optimizer="adam", d_optimizer="adam")
        real = (np.full((4, 2), 3.0, "float32") for _ in iter(int, 1))
        gan_history = kt.GANTrainer(gan, real).train(steps_per_epoch=3, verbose=0)
    errors = {}
    for name in ("DatasetInput", "GeneratorInput"):
        try:
            getattr(kt, name)
        except kt.KerasTowerError as error:
            errors[name] = str(error)
    print(json.dumps({
        "tensorflow_imported": "tensorflow" in sys.modules,
        "steps": model.loop.global_step,
        "loss": history.history["loss"],
        "learning_rate": float(model.optimizer.learning_rate),
        "evaluated": evaluated,
        "predicted_shape": list(predicted.shape),
        "errors": errors,
        "gan_logs": sorted(gan_history.history),
        "gan_steps": int(gan.g_optimizer.iterations.numpy()),
    }))
''')


def test_fit_evaluate_predict_and_callbacks_run_with_tensorflow_refused(tmp_path):
    env = dict(os.environ, KERAS_BACKEND="jax")
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["tensorflow_imported"] is False
    assert result["steps"] == 16  # 64 examples, 2 towers x 8, 3 epochs and 1 more
    assert result["loss"][-1] < result["loss"][0]
    assert abs(result["learning_rate"] - 0.01) < 1e-8
    assert set(result["evaluated"]) == {"loss", "mae"}
    assert result["predicted_shape"] == [64, 1]
    assert result["gan_logs"] == ["d_loss", "g_loss"] and result["gan_steps"] == 3
    # JSONWriter wrote one entry per epoch, with the epoch's logs.
    with open(tmp_path / "stats.json") as f:
        stats = json.load(f)
    assert [entry["epoch_num"] for entry in stats] == [1, 2, 3]
    assert stats[-1]["loss"] == result["loss"][-1]
    # TensorFlow-only names say so, and what to use on JAX.
    assert set(result["errors"]) == {"DatasetInput", "GeneratorInput"}
    assert "KERAS_BACKEND=jax" in result["errors"]["DatasetInput"]
    assert "keras.utils.PyDataset" in result["errors"]["DatasetInput"]
