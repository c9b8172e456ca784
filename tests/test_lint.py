"""The code passes ruff with the rules in pyproject.toml (`[tool.ruff]`); CI runs it with the suite."""

import subprocess
import sys

from tests.conftest import REPO_ROOT


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
