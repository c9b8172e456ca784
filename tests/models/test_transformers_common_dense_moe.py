"""transformers' common model tests for the dense and native-MoE models (harness and accepted failures: _common_harness.py)."""

from __future__ import annotations

import pytest
from _transformers_tests import Unavailable

try:
    from _common_harness import make_test_class
except Unavailable as err:
    pytest.skip(f"transformers' common tests unavailable: {err}", allow_module_level=True)

TestDenseCommon = make_test_class("dense", "dense")
TestMoeCommon = make_test_class("moe", "moe")
