"""transformers' Llama and Mixtral through our harness (_common_harness.py): a test they fail there is a
harness limit, not a difference of ours."""

from __future__ import annotations

import os

import pytest
from _transformers_tests import Unavailable

if not os.environ.get("ADAPTIVE_HF_REFERENCES"):
    pytest.skip("references for the harness, not tests of ours: set ADAPTIVE_HF_REFERENCES=1 to run them",
                allow_module_level=True)
try:
    from _common_harness import make_test_class
except Unavailable as err:
    pytest.skip(f"transformers' common tests unavailable: {err}", allow_module_level=True)

# they test transformers, not us: run them when the harness or the transformers pin changes
TestLlamaReference = pytest.mark.slow(make_test_class("llama_reference", "dense", reference=True))
TestMixtralReference = pytest.mark.slow(make_test_class("mixtral_reference", "moe", reference=True))
