"""Every python example in docs/ runs, and every public name has a
runnable example in its docstring. README.md's examples run as written, in
a fresh process on each backend: tests/shared/test_readme.py."""

import os
import re

import pytest

import kerastower as kt

from tests.helpers.common import ROOT
from tests.helpers.doctests import examples_of
from tests.helpers.doctests import run_examples

PAGES = sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
    # tests/jax/ runs the examples of the pages about JAX alone.
    if name.endswith(".md") and name not in ("jax.md", "sharded-optimizer.md")
)


def python_blocks(page):
    """Each block padded with blank lines to its place in the page, so that
    tracebacks, and AutoGraph reading a function's source, see the page's
    own lines."""
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    return [
        "\n" * text.count("\n", 0, match.start(1)) + match.group(1)
        for match in re.finditer(r"```python\n(.*?)```", text, flags=re.S)
    ]


@pytest.mark.parametrize("page", PAGES)
def test_examples_on_the_page_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what the examples write goes there
    blocks = python_blocks(page)
    namespace = {"__name__": f"docs_{os.path.basename(page)}"}
    for block in blocks:
        exec(compile(block, os.path.join(ROOT, page), "exec"), namespace)


def test_every_test_the_reliability_table_cites_exists():
    """docs/reliability.md names the test proving each row: each must exist."""
    with open(os.path.join(ROOT, "docs", "reliability.md")) as f:
        text = f.read()
    cited, current_file = [], None
    for match in re.finditer(r"`(tests/[\w/]+\.py)?(::\w+)?`", text):
        path, name = match.group(1), match.group(2)
        current_file = path or current_file
        if path and not name:
            cited.append((path, None))
        elif name:
            cited.append((current_file, name[2:]))
    assert len(cited) > 20
    for path, name in cited:
        with open(os.path.join(ROOT, path)) as f:
            source = f.read()
        if name is not None:
            assert re.search(rf"^def {name}\(", source, flags=re.M), f"{path}::{name}"


def test_every_test_the_why_page_cites_exists():
    """docs/why.md backs each kerastower cell with a test: each must exist."""
    with open(os.path.join(ROOT, "docs", "why.md")) as f:
        cited = re.findall(r"`((?:tests/\w+/)?test_\w+\.py)::(\w+)`", f.read())
    assert len(cited) >= 8
    for path, name in cited:
        with open(os.path.join(ROOT, path if "/" in path else os.path.join("tests", "tensorflow", path))) as f:
            assert re.search(rf"^def {name}\(", f.read(), flags=re.M), f"{path}::{name}"


PUBLIC_NAMES = (
    [("kt", name) for name in kt.__all__]
    + [("kt.callbacks", name) for name in kt.callbacks.__all__]
    + [("kt.checkpoint", name) for name in kt.checkpoint.__all__]
)


@pytest.mark.parametrize("module,name", PUBLIC_NAMES)
def test_every_public_name_has_a_docstring_example_that_runs(module, name, tmp_path):
    owner = {"kt": kt, "kt.callbacks": kt.callbacks, "kt.checkpoint": kt.checkpoint}[module]
    found = examples_of(getattr(owner, name), name=f"{module}.{name}", recurse=False)
    assert found, f"{module}.{name}'s docstring has no >>> example"
    failures = run_examples(found, tmp_path)
    assert not failures, failures[-3000:]
