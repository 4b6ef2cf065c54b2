"""Every python example in README.md and docs/ runs."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
    if name.endswith(".md")
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
def test_examples_on_the_page_run(page):
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
