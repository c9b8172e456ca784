"""DeepSpeed MoE without a launcher: forward() creates nothing and says what to call; the explicit
`setup_expert_parallel()` initialises a single-process group (and logs it); the model then still works
under deepspeed.initialize (ZeRO-2, MoE parameter groups). Runs in a fresh interpreter, because
torch.distributed can be initialised once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # deepspeed.initialize in a fresh process

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import io, json, logging, sys
import torch
import torch.distributed as dist
sys.path.insert(0, HELPERS)
log = io.StringIO()
logging.basicConfig(stream=log, level=logging.WARNING)
from _model_helpers import tiny_config
from adaptive.models import AdaptiveForCausalLM

torch.manual_seed(0)
model = AdaptiveForCausalLM(tiny_config("hybrid", moe_implementation="deepspeed"))
ids = torch.randint(0, 128, (2, 16))
try:
    model(ids, labels=ids)
    refused = ""
except Exception as err:
    refused = str(err)
was_initialised = dist.is_initialized()
model.setup_expert_parallel()
first = model(ids, labels=ids).loss.item()

import deepspeed
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "all"})
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-2),
                                       config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}})
losses = []
for _ in range(4):
    loss = engine(ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
print(json.dumps({"refused": refused, "was_initialised": was_initialised, "world": dist.get_world_size(), "first": first,
                  "losses": losses, "log": log.getvalue()}))
"""


def test_deepspeed_moe_forward_creates_nothing_and_setup_initialises_one_process(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    temp = tmp_path / "tmp"
    temp.mkdir()
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TMPDIR=str(temp))
    code = f"HELPERS = {str(Path(__file__).parent)!r}\n" + SCRIPT
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "call model.setup_expert_parallel()" in result["refused"]
    assert not result["was_initialised"], "forward() created a process group"
    assert result["world"] == 1
    assert "initialising a single-process group" in result["log"]
    assert abs(result["losses"][0] - result["first"]) < 1e-5
    assert result["losses"][-1] < result["losses"][0] - 0.1
    assert not [p for p in temp.iterdir() if p.name.startswith("adaptive-")], "a rendezvous file was left behind"
