"""DeepSpeed MoE without a launcher: a model built as transformers builds it (`Model(config)`, `from_config`)
forwards, trains and generates in one process, creating no process group; ep_size > 1 in one process is one
line. The explicit `setup_expert_parallel()` still initialises a single-process group (and logs it), and the
model then works under deepspeed.initialize (ZeRO-2, MoE parameter groups). The refusal under several
processes is checked by test_expert_parallel.py (torchrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _model_helpers import tiny_config, tiny_model

from adaptive.errors import AdaptiveError
from adaptive.models import AdaptiveForCausalLM

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("build", ["init", "from_config"])
def test_deepspeed_moe_built_directly_forwards_and_generates_like_native(build):
    from transformers import AutoModelForCausalLM

    config = tiny_config("hybrid", drop_tokens=False, moe_implementation="deepspeed")
    torch.manual_seed(0)
    model = AdaptiveForCausalLM(config) if build == "init" else AutoModelForCausalLM.from_config(config)
    native = tiny_model("hybrid", drop_tokens=False)
    model.load_state_dict(native.state_dict())  # the native layout, converted on load
    ids = torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    out, ref = model(ids, labels=ids), native(ids, labels=ids)
    torch.testing.assert_close(out.loss, ref.loss)
    out.loss.backward()
    assert any(p.grad is not None for n, p in model.named_parameters() if "deepspeed_experts" in n)
    model.eval(), native.eval()
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **greedy), native.generate(ids, **greedy))


def test_deepspeed_moe_with_ep_size_2_in_one_process_is_one_line():
    model = AdaptiveForCausalLM(tiny_config("moe", moe_implementation="deepspeed", ep_size=2))
    with pytest.raises(AdaptiveError, match=r"^ep_size \(2\) needs 2 processes and this is one: launch with torchrun "
                                            r"--nproc_per_node 2 or set ep_size=1$"):
        model(torch.randint(0, 128, (1, 8)))


SCRIPT = r"""
import io, json, logging, sys
import torch
import torch.distributed as dist
sys.path.insert(0, HELPERS)
log = io.StringIO()
logging.basicConfig(stream=log, level=logging.WARNING)
from _model_helpers import tiny_config
from transformers import AutoModelForCausalLM
from deepspeed.utils import groups as ds_groups
from adaptive.models import AdaptiveForCausalLM

torch.manual_seed(0)
model = AdaptiveForCausalLM(tiny_config("hybrid", moe_implementation="deepspeed"))
ids = torch.randint(0, 128, (2, 16))
first = model(ids, labels=ids).loss.item()
other = AutoModelForCausalLM.from_config(tiny_config("moe", moe_implementation="deepspeed"))
other.generate(ids[:, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
created = {"torch_distributed": dist.is_initialized(), "deepspeed_groups": sorted(ds_groups._get_expert_parallel_group_dict())}
model.setup_expert_parallel()
after_setup = model(ids, labels=ids).loss.item()

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
print(json.dumps({"created": created, "world": dist.get_world_size(), "first": first, "after_setup": after_setup,
                  "losses": losses, "log": log.getvalue()}))
"""


@pytest.mark.slow  # deepspeed.initialize in a fresh process
def test_deepspeed_moe_forward_creates_nothing_and_setup_initialises_one_process(tmp_path):
    # a fresh interpreter: only there does "torch.distributed was not initialised before" hold
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    temp = tmp_path / "tmp"
    temp.mkdir()
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TMPDIR=str(temp))
    code = f"HELPERS = {str(Path(__file__).parent)!r}\n" + SCRIPT
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["created"] == {"torch_distributed": False, "deepspeed_groups": []}, "forward created process groups"
    assert result["world"] == 1
    assert "initialising a single-process group" in result["log"]
    assert abs(result["after_setup"] - result["first"]) < 1e-5, "groups change nothing in one process"
    assert abs(result["losses"][0] - result["first"]) < 1e-5
    assert result["losses"][-1] < result["losses"][0] - 0.1
    assert not [p for p in temp.iterdir() if p.name.startswith("adaptive-")], "a rendezvous file was left behind"
