"""Shared fixtures for the training-side tests: offline hub, private caches, one tokenizer."""

from __future__ import annotations

import os

# Before anything imports huggingface_hub or datasets: both read these once, at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def adaptive_cache(tmp_path_factory):
    """A private $ADAPTIVE_CACHE for the whole session, so tests never touch ~/.cache."""
    path = tmp_path_factory.mktemp("adaptive-cache")
    old = os.environ.get("ADAPTIVE_CACHE")
    os.environ["ADAPTIVE_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("ADAPTIVE_CACHE", None)
    else:
        os.environ["ADAPTIVE_CACHE"] = old


@pytest.fixture(scope="session")
def tokenizer(adaptive_cache):
    """The built-in tokenizer (vocab 2048), built once per session."""
    from adaptive.train.data.tokenizer import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def datasets_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf-datasets"))
