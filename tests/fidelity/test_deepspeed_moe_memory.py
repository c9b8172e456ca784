"""`adaptive measure` and the formula follow the native MoE block (DeepSpeed's MOELayer cannot run on
fake tensors); training runs DeepSpeed's. On real tensors the two hold the same bytes: what the forward
saves and the backward's working set, for the whole debug MoE model."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, subprocess_env

pytestmark = pytest.mark.slow  # DeepSpeed MoE steps in fresh processes


def step_memory(impl: str) -> dict:
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tests/fidelity/_moe_memory_worker.py"), impl, "512", "2"],
                         capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_deepspeed_moe_step_holds_what_the_native_block_holds():
    native, deepspeed = step_memory("native"), step_memory("deepspeed")
    assert native["backward"] > 0.2 * native["after_forward"]  # a step whose backward matters
    for key in ("after_forward", "backward", "peak"):
        assert deepspeed[key] == pytest.approx(native[key], rel=0.001), key
