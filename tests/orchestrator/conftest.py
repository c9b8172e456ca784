"""In-process orchestrator tests run tiny models: one intra-op thread is faster than two on a shared
2-core machine (OpenMP threads wait on each other), and leaves the other core to subprocesses."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def fault_runs(tmp_path_factory):
    """The clean and the faulty debug-MoE runs (tests/orchestrator/_launch.py), shared by the fault and
    report tests."""
    from tests.orchestrator._launch import start_fault_runs

    return start_fault_runs(tmp_path_factory.mktemp("fault_runs"))
