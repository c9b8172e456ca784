"""`import adaptive` registers the classes with transformers' Auto classes, in either import order,
without importing torch itself. Each check runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _model_helpers import tiny_model

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_import_adaptive_stays_torch_free():
    out = run_python("import sys, adaptive; print(sorted(m for m in ('torch', 'transformers', 'deepspeed') "
                     "if m in sys.modules))")
    assert out.strip() == "[]"


@pytest.mark.parametrize("order", ["adaptive_first", "transformers_first"])
def test_auto_model_loads_a_saved_model(tmp_path, order):
    model = tiny_model("hybrid")
    model.save_pretrained(tmp_path)
    imports = ("import adaptive\nimport transformers" if order == "adaptive_first"
               else "import transformers\nimport adaptive")
    out = run_python(
        f"{imports}\n"
        "from transformers import AutoConfig, AutoModel, AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})\n"
        f"b = AutoModel.from_pretrained({str(tmp_path)!r})\n"
        f"c = AutoConfig.from_pretrained({str(tmp_path)!r})\n"
        "from adaptive.models import register_auto_classes\n"
        "register_auto_classes(); register_auto_classes()  # idempotent\n"
        "assert adaptive.AdaptiveForCausalLM is type(m)  # lazy attribute\n"
        "print(type(m).__name__, type(b).__name__, type(c).__name__, c.block_types)\n"
    )
    assert out.split()[:3] == ["AdaptiveForCausalLM", "AdaptiveModel", "AdaptiveConfig"]
    assert "'hybrid'" in out
