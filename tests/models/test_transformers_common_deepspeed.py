"""transformers' common model tests for the MoE model on DeepSpeed's MoE layer (harness: _common_harness.py)."""

from __future__ import annotations

import pytest
from _transformers_tests import Unavailable

try:
    from _common_harness import make_test_class
except Unavailable as err:
    pytest.skip(f"transformers' common tests unavailable: {err}", allow_module_level=True)

TestMoeDeepspeedCommon = pytest.mark.slow(make_test_class("moe_deepspeed", "moe", "deepspeed"))
