import os
import sys
from pathlib import Path

import pytest

# `pytest -n 2` runs a worker per core: one intra-op thread each. Two OpenMP threads per worker spin-wait on
# each other and on the other worker, which made tiny models 2-3x slower; subprocesses inherit the setting.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Tests never touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

# DeepSpeed's ops are built with the ninja the runs use, in this process (tests that start DeepSpeed in-process)
# and its children: another ninja's build is rebuilt (adaptive.engine.pin_ninja)
try:
    from adaptive.engine import pin_ninja

    pin_ninja()
except ImportError:  # a checkout without adaptive importable: nothing builds ops then
    pass

REPO_ROOT = Path(__file__).resolve().parents[1]


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: this checkout first on the path, offline."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def python() -> str:
    return sys.executable
