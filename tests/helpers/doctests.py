"""Runs the `>>>` examples of kerastower's docstrings, after one shared preamble.

Every docstring example starts from `PREAMBLE`, as Keras's own docstrings
assume `keras` and `np`: an example imports only what else it needs. Each
example runs in a fresh namespace, in the folder it is given (what an
example writes goes there).
"""

import doctest
import os

__all__ = ["PREAMBLE", "examples_of", "run_examples"]

PREAMBLE = "import keras, numpy as np, kerastower as kt"
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _namespace():
    namespace = {"__name__": "__main__"}  # as doctest gives examples
    exec(PREAMBLE, namespace)
    return namespace


def examples_of(owner, name=None, recurse=True):
    """The doctests with examples in `owner`'s docstrings (a module, class or
    function; `recurse`: its members' too)."""
    finder = doctest.DocTestFinder(recurse=recurse)
    name = name or getattr(owner, "__name__", None)
    return [test for test in finder.find(owner, name=name, globs={}) if test.examples]


def run_examples(tests, folder):
    """Runs `tests` in `folder`, each after the preamble; returns the report
    of the failures ("" when every example passed)."""
    report, before = [], os.getcwd()
    os.chdir(folder)
    try:
        for test in tests:
            test.globs = _namespace()
            doctest.DocTestRunner(optionflags=FLAGS).run(test, out=report.append)
            test.globs.clear()
    finally:
        os.chdir(before)
    return "".join(report)
