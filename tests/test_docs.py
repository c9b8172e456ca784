"""The documentation site builds with `mkdocs build --strict` (mkdocs.yml over docs/): a link between pages or an
#anchor that does not resolve fails it, as in CI (.ci/run). Needs the docs extra: `pip install -e ".[docs]"`."""

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
                    reason='mkdocs-material is not installed (pip install -e ".[docs]")')
def test_the_site_builds_strict(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=120,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file() and (tmp_path / "site" / "BENCHMARKS" / "index.html").is_file()
