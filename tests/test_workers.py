"""The suite's own set-up: `pytest -n 2` gives each worker one intra-op thread (tests/conftest.py)."""

import os

import pytest


def test_an_xdist_worker_runs_torch_on_one_thread():
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("the suite runs this under pytest -n 2 (README, .ci/run)")
    import torch

    assert torch.get_num_threads() == 1, "two threads per worker on 2 cores spin-wait on each other"
