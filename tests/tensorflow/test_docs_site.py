"""The docs site (mkdocs.yml) builds strictly: every page of the nav, every
link and anchor, and the API reference of every public name resolve."""

import os
import shutil
import subprocess
import sys

import kerastower as kt

from tests.helpers.common import ROOT


def _build(root, site):
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=root, capture_output=True, text=True, timeout=600,
    )


def test_the_docs_site_builds_strictly_with_every_public_name(tmp_path):
    result = _build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stderr[-4000:]
    with open(tmp_path / "site" / "api" / "index.html") as f:
        api = f.read()
    public = (
        [f"kerastower.{name}" for name in kt.__all__]
        + [f"kerastower.callbacks.{name}" for name in kt.callbacks.__all__]
        + [f"kerastower.checkpoint.{name}" for name in kt.checkpoint.__all__]
    )
    missing = [name for name in public if f'id="{name}"' not in api]
    assert not missing, f"public names without an API entry: {missing}"
    # A `>>>` example outside an `Examples:` section renders as nested quotes.
    assert "<blockquote>" not in api, "a docstring example is not under Examples:"
    assert api.count('<span class="gp">&gt;&gt;&gt; </span>') > 300


def test_a_broken_link_fails_the_build(tmp_path):
    copy = tmp_path / "repo"
    for name in ("docs", "kerastower"):
        shutil.copytree(os.path.join(ROOT, name), copy / name)
    os.makedirs(copy / "benchmarks")
    shutil.copy(os.path.join(ROOT, "benchmarks", "RESULTS.md"), copy / "benchmarks")
    shutil.copy(os.path.join(ROOT, "mkdocs.yml"), copy)
    with open(copy / "docs" / "towers.md", "a") as f:
        f.write("\nSee [a page that is not there](no-such-page.md).\n")
    result = _build(copy, tmp_path / "site")
    assert result.returncode != 0 and "no-such-page.md" in result.stderr, result.stderr[-2000:]
