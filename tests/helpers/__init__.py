"""What the test folders share; importing this package changes nothing (common.py makes the devices)."""

import os

# The repository's root: tests/ and examples/ import from it, in every process.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
