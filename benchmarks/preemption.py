"""How long a preempted run takes from the signal to its exit (issue 28).

    python benchmarks/preemption.py [--rounds 3]

For two models, each trained on 2 towers with AutoResume and an epoch-end
ModelSaver in a process of its own: examples/train_digits.py's ConvNet on
scikit-learn's digits, and a Dense model of 100 MB of float32 weights
(5000 x 5000, Adam: a 300 MB checkpoint with its two slots). Once the run
has done 3 steps, SIGTERM is sent; the time until the process has exited
(status 75) is what a scheduler's grace period must cover. The process's
own account of the save ("saved ... in X s") is printed beside it. Runs on
the backend KERAS_BACKEND names.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/preemption.py --agreement

times what a step pays for the agreement when a run has several processes:
one all-reduce of a flag (`kerastower/loop/preemption.py: stop_agreed`).
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(model_name, folder):
    """Trains until signalled, leaving a file after every step."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    import keras

    if keras.backend.backend() == "jax":
        import jax

        devices = jax.devices()[:2]  # XLA_FLAGS=--xla_force_host_platform_device_count=2
    else:
        from example_devices import tower_devices

        devices = tower_devices(2)
    import numpy as np

    import kerastower as kt

    class Mark(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            open(os.path.join(folder, f"step-{self.model.loop.global_step}"), "w").close()
            time.sleep(0.05)  # the signal comes between steps' work, as it would mid-step

    with kt.distributed("mirrored", devices=devices):
        if model_name == "digits":
            from train_digits import build_model
            from train_digits import load_digits

            (x, y), _ = load_digits()
            model = build_model()
            batch = 32
        else:
            inputs = keras.Input((5000,))
            model = kt.TowerModel(inputs, keras.layers.Dense(5000, use_bias=False)(inputs))
            x = np.random.default_rng(0).normal(size=(2000, 5000)).astype("float32")
            y = x[:, :5000] * 0.5
            batch = 8
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True) if model_name == "digits" else "mse")
    ckpt = os.path.join(folder, "ckpt")
    model.fit(x, y, batch_size=batch, epochs=1000, verbose=2, callbacks=[
        kt.callbacks.AutoResume(ckpt), kt.callbacks.ModelSaver(ckpt), Mark()])


def measure(model_name):
    folder = tempfile.mkdtemp()
    try:
        env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
                   + " --xla_force_host_platform_device_count=2")
        process = subprocess.Popen([sys.executable, __file__, "--child", model_name, folder], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 600
        while not os.path.exists(os.path.join(folder, "step-3")):
            if process.poll() is not None or time.time() > deadline:
                raise RuntimeError(process.communicate()[0][-3000:])
            time.sleep(0.01)
        sent = time.perf_counter()
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=600)
        exited = time.perf_counter() - sent
        if process.returncode != 75:
            raise RuntimeError(f"exit status {process.returncode}:\n{output[-3000:]}")
        saved = re.search(r"saved (\S+) in ([0-9.]+) s", output)
        size = sum(os.path.getsize(os.path.join(saved.group(1), f))
                   for f in os.listdir(saved.group(1)))
        return exited, float(saved.group(2)), size
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def agreement(calls=500):
    """The time of one `stop_agreed` on 2 Horovod ranks (median of 5 rounds)."""
    import statistics

    import kerastower as kt
    from kerastower.loop.preemption import SignalWatch
    from kerastower.loop.preemption import stop_agreed

    with kt.distributed("horovod") as strategy:
        watch = SignalWatch([])
        stop_agreed(watch, strategy)
        rounds = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                stop_agreed(watch, strategy)
            rounds.append((time.perf_counter() - start) / calls)
        if strategy.is_chief:
            print(f"horovod, 2 ranks: {statistics.median(rounds) * 1e3:.3f} ms per step "
                  f"(rounds: {', '.join(f'{r * 1e3:.3f}' for r in rounds)})", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=2)
    parser.add_argument("--agreement", action="store_true")
    args = parser.parse_args()
    if args.agreement:
        return agreement()
    if args.child:
        return child(*args.child)
    import keras

    print(f"backend {keras.backend.backend()}: signal to exit (s), of which the save "
          "(write + verify) (s), checkpoint size; median of rounds")
    for model_name in ("digits", "dense-100MB"):
        results = sorted(measure(model_name) for _ in range(args.rounds))
        exited, saved, size = results[len(results) // 2]
        print(f"{model_name:12s} signal->exit {exited:6.2f} s  save {saved:6.2f} s  "
              f"checkpoint {size / 1e6:7.1f} MB  (all rounds: "
              f"{', '.join(f'{r[0]:.2f}' for r in results)})", flush=True)


if __name__ == "__main__":
    main()
