"""`fit --ds-config` and `fit --optimizer` against real DeepSpeed engines on the CPU.

A user's ZeRO-2 JSON with 5e8-element buckets must plan a higher peak than the same JSON with 2e8, by
the bucket bytes (a real engine built from the very file, its "auto" values filled as accelerate
would). torch's foreach AdamW (`--optimizer adamw_torch`) against the fused default, per ZeRO stage:
its fp32 temporary (4 bytes per updated parameter) comes on top of the step under ZeRO-0, partly
under ZeRO-3 (2 bytes net: DeepSpeed frees a 16-bit partition copy before the update) and not at all
under ZeRO-1/2 (DeepSpeed 0.19.8 flattens the 16-bit gradient partition before the update, a moment
that already holds as much). Every peak and every difference is measured: real engines train a small
Llama for two steps under `MemTracker` (tests/plan/estimate/_deepspeed_peak_worker.py), as
test_memory_measured_deepspeed.py does for the ZeRO stages and gradient accumulation.
"""

import json
import subprocess
import sys

import pytest

from adaptive.plan import fit, make_request
from adaptive.plan.ds_config.reader import drivers
from adaptive.plan.ds_config.emit import ds_config
from adaptive.plan.hardware.gpus import get_gpu
from adaptive.plan.architecture.params import count_params
from tests.conftest import REPO_ROOT, subprocess_env

pytestmark = pytest.mark.slow  # real DeepSpeed engines in fresh processes

CONFIG = dict(model_type="llama", vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=4)
SEQ = 8


def user_ds_config(reduce_bucket: float) -> dict:
    """A ZeRO-2 file as users write them (the DeepSpeed/transformers docs' example), batch sizes "auto"."""
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_scatter": True, "reduce_bucket_size": reduce_bucket,
                                  "allgather_bucket_size": reduce_bucket}}


def filled(cfg: dict) -> dict:
    """The "auto" values as accelerate fills them for micro-batch 1, no accumulation, one GPU, bf16."""
    return dict(cfg, train_batch_size=1, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
                bf16={"enabled": True})


BUCKETS = {"buckets_5e8": 5e8, "buckets_2e8": 2e8}
# name -> (ZeRO stage, optimizer the engine runs, --optimizer planned); the config our emitter writes
OPTIMIZER_RUNS = {f"z{stage}_{kind}": (stage, kind, planned) for stage in (0, 2, 3)
                  for kind, planned in (("fused", "adamw_torch_fused"), ("foreach", "adamw_torch"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    model = root / "config.json"
    model.write_text(json.dumps(CONFIG))
    plans, engines = {}, {}
    for name, bucket in BUCKETS.items():
        path = root / f"{name}.json"
        path.write_text(json.dumps(user_ds_config(bucket)))
        request = make_request(model=str(model), gpu="a100-80gb", seq_len=SEQ, global_batch_tokens=SEQ,
                               micro_batch=1, grad_accum=1, checkpointing=False, ds_config=str(path))
        plans[name] = fit(request)
        engines[name] = {"ds": filled(user_ds_config(bucket)), "optimizer": "fused"}
    for name, (stage, kind, planned) in OPTIMIZER_RUNS.items():
        request = make_request(model=str(model), gpu="a100-80gb", seq_len=SEQ, global_batch_tokens=SEQ, zero=stage,
                               offload="none", micro_batch=1, grad_accum=1, checkpointing=False, optimizer=planned)
        plans[name] = fit(request)
        engines[name] = {"ds": ds_config(plans[name].shown.setup, 1, get_gpu("a100-80gb")), "optimizer": kind}
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tests/plan/estimate/_deepspeed_peak_worker.py"),
                          json.dumps(CONFIG), json.dumps(engines), str(SEQ)],
                         capture_output=True, text=True, env=subprocess_env(), timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    return plans, json.loads(out.stdout.strip().splitlines()[-1])


def test_ds_config_bigger_buckets_plan_a_higher_peak_by_the_bucket_bytes(runs):
    plans, measured = runs
    big, small = (plans[n].shown.memory for n in ("buckets_5e8", "buckets_2e8"))
    bucket_bytes = 2 * (5e8 - 2e8) * 2  # two buffers (overlap_comm), 3e8 more elements, bf16
    assert big.allocated_peak_bytes - small.allocated_peak_bytes == pytest.approx(bucket_bytes, abs=1)
    measured_diff = measured["buckets_5e8"] - measured["buckets_2e8"]
    assert measured_diff == pytest.approx(bucket_bytes, rel=0.01), measured
    for name in ("buckets_5e8", "buckets_2e8"):
        assert plans[name].shown.memory.allocated_peak_bytes == pytest.approx(measured[name], rel=0.02), name


def test_ds_config_says_the_buckets_drive_the_peak(runs):
    plans, _ = runs
    c = plans["buckets_5e8"].shown
    assert c.setup.zero_stage == 2 and c.setup.reduce_bucket_elements == 5e8 and c.setup.overlap_comm
    found = {part: why for part, _, why in drivers(plans["buckets_5e8"].request.ds_config, c.memory.parts, 2)}
    assert "reduce_bucket_size = 5e+08" in found["comm_buckets"]
    assert "overlap_comm on" in found["comm_buckets"]


# net bytes per updated parameter that foreach AdamW adds over fused, by ZeRO stage (module docstring)
FOREACH_NET = {0: 4, 2: 0, 3: 2}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_foreach_adamw_plans_more_than_fused_by_its_fp32_temporaries_where_they_show(runs, stage):
    plans, measured = runs
    fused, foreach = (plans[f"z{stage}_{k}"].shown.memory for k in ("fused", "foreach"))
    assert fused.peak_phase == foreach.peak_phase == "optimizer_step"
    params = count_params(plans[f"z{stage}_fused"].request.spec).total  # one GPU: it updates every parameter
    assert foreach.parts["optimizer_transient"] == 4 * params and fused.parts["optimizer_transient"] == 0
    added = FOREACH_NET[stage] * params
    assert foreach.allocated_peak_bytes - fused.allocated_peak_bytes == added
    diff = measured[f"z{stage}_foreach"] - measured[f"z{stage}_fused"]
    assert diff == pytest.approx(added, abs=0.01 * params), measured
    for kind in ("fused", "foreach"):
        name = f"z{stage}_{kind}"
        assert plans[name].shown.memory.allocated_peak_bytes == pytest.approx(measured[name], rel=0.02), name
