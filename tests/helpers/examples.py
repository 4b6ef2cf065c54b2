"""The programs in examples/, imported the way running one imports it.

`python examples/gan_digits.py` puts examples/ first on the path, and each
example imports its neighbour `example_devices.py` from there; the tests
that reuse an example's classes import it the same way, here only.
"""

import importlib
import os
import sys

from tests.helpers import ROOT  # not common.py: an example's process makes its own devices

EXAMPLES = os.path.join(ROOT, "examples")


def import_example(name):
    """examples/<name>.py as a module, e.g. `import_example("kmeans_digits").KMeans`."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    return importlib.import_module(name)
