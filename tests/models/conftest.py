from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ARCHS = ("dense", "moe", "mod", "hybrid")


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param
