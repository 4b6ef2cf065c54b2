"""README.md's python examples run as written, on this backend.

In a fresh process with only KERAS_BACKEND set (no forced devices, no
logical CPU split done beforehand), as a user who copies them into a file
runs them: the first example's `kt.use_cpu_towers(2)` must split the CPU
itself, on TensorFlow and on JAX alike.
"""

import os
import re
import subprocess
import sys

from tests.helpers.common import ROOT
from tests.helpers.common import BACKEND



def readme_python_blocks():
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_readme_examples_run_as_written_on_this_backend(tmp_path):
    blocks = readme_python_blocks()
    assert blocks, "README.md has no python example"
    script = tmp_path / "readme_examples.py"
    script.write_text("\n".join(blocks) + "\nimport kerastower as _kt, keras as _keras\n"
                      "print('BACKEND', _keras.backend.backend())\n")
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env.update(KERAS_BACKEND=BACKEND, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    printed = run.stdout.strip().splitlines()
    assert printed[-1] == f"BACKEND {BACKEND}"
    # The first example prints its evaluation: a dict with the loss and accuracy.
    assert "'accuracy'" in printed[0] and "'loss'" in printed[0], printed
