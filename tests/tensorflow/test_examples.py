"""The README's main example runs and leaves readable TensorBoard logs.

It also guards a crash: its last step of every epoch leaves tower 1 without
a batch, and running MaxPooling's gradient on an empty batch aborts
TensorFlow's CPU build; kerastower must skip the model on that tower.
"""

import glob
import json
import os
import re
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing import event_accumulator

from tests.helpers.common import ROOT


def test_train_digits_example(tmp_path):
    logdir = tmp_path / "logs"
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_digits.py"),
         "--epochs", "3", "--logdir", str(logdir)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert out.count("kerastower: 2 tower(s) x 32 examples = total batch 64 per step") == 1
    accuracy = float(re.search(r"final test accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.9, out
    train_runs = glob.glob(str(logdir / "train"))
    assert train_runs, os.listdir(logdir)
    accumulator = event_accumulator.EventAccumulator(train_runs[0])
    accumulator.Reload()
    tags = accumulator.Tags()["tensors"] + accumulator.Tags()["scalars"]
    assert "epoch_loss" in tags, tags
    losses = [event for event in (accumulator.Tensors("epoch_loss")
                                  if "epoch_loss" in accumulator.Tags()["tensors"]
                                  else accumulator.Scalars("epoch_loss"))]
    assert len(losses) == 3
    with open(logdir / "stats.json") as f:
        records = json.load(f)
    assert [r["epoch_num"] for r in records] == [1, 2, 3]
    assert records[-1]["val_accuracy"] == pytest.approx(accuracy, abs=1e-4)


def test_kmeans_digits_example_resumes(tmp_path):
    """Runs 1 epoch, then again to 2 epochs on the same checkpoints: the
    second run trains only epoch 2."""
    script = os.path.join(ROOT, "examples", "kmeans_digits.py")
    outputs = []
    for epochs in (1, 2):
        result = subprocess.run(
            [sys.executable, script, "--epochs", str(epochs), "--steps", "10", "--ckpt", str(tmp_path)],
            capture_output=True, text=True, timeout=600, cwd=ROOT,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        outputs.append(result.stdout)
    assert re.findall(r"\[epoch (\d+), step (\d+)\] inertia", outputs[0]) == [("1", "10")]
    assert re.findall(r"\[epoch (\d+), step (\d+)\] inertia", outputs[1]) == [("2", "20")]
    purity = float(re.search(r"cluster purity: ([0-9.]+)", outputs[1]).group(1))
    assert purity > 0.6, outputs[1]
