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

    python benchmarks/preemption.py --agreement [--rounds 5]

times what a step pays for the stop agreement when a run has several
processes (`kerastower/loop/preemption.py: StopAgreement`), on 2 and 4
Horovod ranks and multi-worker workers on loopback: a small MLP's
milliseconds a step (steps 20 to 220 of a fit, timed by a callback, so
fit's fixed costs are left out) without AutoResume, with AutoResume
agreeing after every step (as before issue 55), and with AutoResume's
default (every few steps, at most 0.5% of their time), alternating in
each process; the chief prints the medians, the median of the rounds'
ratios, and the agreements' own share of the steps' time (the time
inside their all-reduces over the steps' time, taken in the same fit, so
what other processes on the machine do cancels out).
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


AGREEMENT_STEPS, AGREEMENT_SKIPPED = 220, 20


def agreement_child(strategy_name, folder, rounds):
    """One process of the agreement benchmark (a Horovod rank or a worker)."""
    import statistics

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import kerastower as kt

    with kt.distributed(strategy_name) as strategy:
        import keras
        import numpy as np

        from kerastower.loop import preemption

        # The time spent in the agreements' all-reduces, measured where they run.
        agreeing = {"s": 0.0, "calls": 0}
        sum_over_processes = strategy.sum_over_processes

        def timed_sum(values):
            start = time.perf_counter()
            try:
                return sum_over_processes(values)
            finally:
                agreeing["s"] += time.perf_counter() - start
                agreeing["calls"] += 1

        strategy.sum_over_processes = timed_sum
        timed = AGREEMENT_STEPS - AGREEMENT_SKIPPED

        class StepTimes(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == AGREEMENT_SKIPPED - 1:
                    self.start = time.perf_counter()
                    self.agreeing = dict(agreeing)
                elif batch == AGREEMENT_STEPS - 1:
                    self.ms = (time.perf_counter() - self.start) / timed * 1e3
                    self.agreement_ms = (agreeing["s"] - self.agreeing["s"]) / timed * 1e3
                    self.calls = agreeing["calls"] - self.agreeing["calls"]

        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(32, activation="relu")(inputs)
        model = kt.TowerModel(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer="sgd", loss="mse")
        x = np.random.default_rng(0).normal(size=(8 * AGREEMENT_STEPS * strategy.num_towers, 16))
        x = x.astype("float32")
        y = x[:, :1]
        default_seconds = preemption.MOST_SECONDS_BETWEEN
        modes = {"none": None, "every step": 0.0, "default": default_seconds}
        times = {mode: [] for mode in modes}
        shares = {mode: [] for mode in modes}   # the agreements' time over the steps'
        calls = {mode: [] for mode in modes}
        for _ in range(rounds + 1):   # the first round warms up
            for mode, seconds in modes.items():
                timer = StepTimes()
                callbacks = [timer]
                if seconds is not None:
                    preemption.MOST_SECONDS_BETWEEN = seconds
                    callbacks.append(kt.callbacks.AutoResume(os.path.join(folder, "ckpt")))
                model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
                times[mode].append(timer.ms)
                shares[mode].append(timer.agreement_ms / timer.ms)
                calls[mode].append(timer.calls)
        preemption.MOST_SECONDS_BETWEEN = default_seconds
        if strategy.is_chief:
            medians = {mode: statistics.median(t[1:]) for mode, t in times.items()}
            ratios = {mode: statistics.median(n / m for n, m in zip(times["none"][1:], t[1:]))
                      for mode, t in times.items()}
            print(f"RESULT {strategy_name} {strategy.num_towers}: " + "; ".join(
                f"{mode} {medians[mode]:.3f} ms a step (speed {ratios[mode]:.3f} of none, "
                f"agreements {statistics.median(calls[mode][1:]):.0f} taking "
                f"{100 * statistics.median(shares[mode][1:]):.2f}% of the steps' time)"
                for mode in modes), flush=True)


def agreement(rounds):
    """The agreement benchmark on 2 and 4 Horovod ranks and workers."""
    import json
    import socket

    def free_port():
        with socket.socket() as s:
            s.bind(("localhost", 0))
            return s.getsockname()[1]

    for processes in (2, 4):
        for strategy_name in ("horovod", "multiworker"):
            folder = tempfile.mkdtemp()
            command = [sys.executable, __file__, "--agreement-child", strategy_name, folder,
                       "--rounds", str(rounds)]
            try:
                if strategy_name == "horovod":
                    launched = [subprocess.Popen(
                        ["horovodrun", "-np", str(processes), "-H", f"localhost:{processes}",
                         "--gloo"] + command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True)]
                else:
                    addresses = [f"localhost:{free_port()}" for _ in range(processes)]
                    launched = [subprocess.Popen(command, env=dict(os.environ, TF_CONFIG=json.dumps(
                        {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": i}})),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                        for i in range(processes)]
                outputs = [process.communicate(timeout=1800)[0] for process in launched]
                lines = [line[line.index("RESULT") + 7:] for output in outputs
                         for line in output.splitlines() if "RESULT" in line]
                if not lines:
                    raise RuntimeError(outputs[0][-3000:])
                print(lines[0], flush=True)
            finally:
                shutil.rmtree(folder, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=2)
    parser.add_argument("--agreement", action="store_true")
    parser.add_argument("--agreement-child", nargs=2)
    args = parser.parse_args()
    if args.agreement_child:
        return agreement_child(*args.agreement_child, args.rounds)
    if args.agreement:
        return agreement(args.rounds)
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
