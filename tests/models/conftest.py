from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ARCHS = ("dense", "moe", "mod", "hybrid")


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


def pytest_collection_modifyitems(items) -> None:
    """Mark tests a class lists in `expected_failures` ({name regex: reason}) as xfail(strict=True): a listed
    test that starts passing fails the run, so the list of accepted differences never goes stale."""
    import re

    for item in items:
        reasons = getattr(getattr(item, "cls", None), "expected_failures", None)
        if not reasons:
            continue
        for pattern, reason in reasons.items():
            if re.fullmatch(pattern, item.name):
                item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
