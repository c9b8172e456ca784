"""How a run is sized: which DeepSpeed config wins (flag, accelerate config file, accelerate settings, plan),
how its "auto" values and pins combine with the planner, precision per device, CPU defaults, run length."""

from __future__ import annotations

import json

import pytest

from adaptive.errors import AdaptiveError
from adaptive.plan import get_gpu
from adaptive.config.commandline import parse
from adaptive.train.run.runplan import Device, World, deepspeed_source, plan_run
from tests.train._launch import REPO

ZERO2 = str(REPO / "ds_configs" / "zero2.json")
ZERO3_OFFLOAD = str(REPO / "ds_configs" / "zero3_offload_all.json")
A100 = Device("cuda", get_gpu("a100-80gb"))
T4 = Device("cuda", get_gpu("t4"))
CPU = Device("cpu", None)
ACC = {"ACCELERATE_USE_DEEPSPEED": "true"}


def run_plan(preset="debug", arch="dense", flags=(), world=World(), device=A100, env=None):
    return plan_run(parse("train", list(flags)), preset, arch, world, device, env or {})


def test_the_source_is_the_flag_then_accelerate_then_the_plan(tmp_path):
    assert deepspeed_source(ZERO2, {**ACC, "ACCELERATE_DEEPSPEED_CONFIG_FILE": ZERO3_OFFLOAD}).kind == "file"
    src = deepspeed_source(None, {**ACC, "ACCELERATE_DEEPSPEED_CONFIG_FILE": ZERO3_OFFLOAD})
    assert (src.kind, src.path) == ("accelerate", ZERO3_OFFLOAD)
    assert src.pins == {"zero": 3, "offload": "all", "clipping": 1.0}
    src = deepspeed_source(None, {**ACC, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1",
                                  "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
                                  "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"})
    assert (src.kind, src.pins) == ("accelerate", {"zero": 1, "offload": "optimizer", "grad_accum": 4})
    assert deepspeed_source(None, ACC).kind == "plan"  # --use_deepspeed alone names no setting
    assert deepspeed_source(None, {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}).kind == "plan"  # not a DeepSpeed launch


def test_a_file_pins_the_planner_and_its_auto_values_come_from_the_plan():
    run = run_plan("b1", "dense", ["--ds-config", ZERO2], world=World(8, 8))
    cfg, k = run.ds_config, run.knobs
    assert k.zero_stage == 2 and not k.offload_optimizer
    assert cfg["train_micro_batch_size_per_gpu"] == k.micro_batch_size == run.plan.shown.setup.micro_batch_size
    assert cfg["gradient_accumulation_steps"] == k.gradient_accumulation_steps
    assert cfg["train_batch_size"] == k.micro_batch_size * k.gradient_accumulation_steps * 8
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    assert "auto" not in json.dumps(cfg)


def test_explicit_file_values_are_kept_and_flags_may_not_contradict_them(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8,
                                "zero_optimization": {"stage": 1}, "fp16": {"enabled": True}}))
    run = run_plan("debug", "moe", ["--ds-config", str(path)], device=T4)
    assert (run.knobs.micro_batch_size, run.knobs.gradient_accumulation_steps, run.knobs.zero_stage) == (2, 8, 1)
    assert run.precision == "fp16" and run.ds_config["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    with pytest.raises(AdaptiveError, match="--micro-batch 4 contradicts 2"):
        run_plan("debug", "moe", ["--ds-config", str(path), "--micro-batch", "4"], device=T4)
    with pytest.raises(AdaptiveError, match="--mixed_precision bf16 contradicts fp16"):
        run_plan("debug", "dense", ["--ds-config", str(path)], device=T4, env={"ACCELERATE_MIXED_PRECISION": "bf16"})
    with pytest.raises(AdaptiveError, match="t4-16gb has no bf16"):
        run_plan("debug", "dense", device=T4, env={"ACCELERATE_MIXED_PRECISION": "bf16"})


def test_precision_follows_the_gpu_and_is_fp32_on_a_cpu():
    assert run_plan(device=A100).precision == "bf16"
    t4 = run_plan(device=T4)
    assert t4.precision == "fp16" and t4.ds_config["fp16"]["enabled"] is True and "bf16" not in t4.ds_config
    cpu = run_plan(device=CPU)
    assert cpu.precision == "fp32" and "bf16" not in cpu.ds_config and "fp16" not in cpu.ds_config


def test_a_cpu_run_uses_small_knobs_and_has_no_mfu_peak():
    run = run_plan("b1", "moe", device=CPU, world=World(2, 2))
    k = run.knobs
    assert (k.seq_len, k.micro_batch_size, k.gradient_accumulation_steps, k.offload_optimizer, k.ep_size) == \
        (128, 4, 1, False, 1)
    assert run.max_steps == 100 and run.peak_tflops is None and run.plan.request.gpu.name == "a100-80gb"
    assert run.ds_config["train_batch_size"] == 8
    assert run_plan("debug", "moe", ["--ep-size", "2"], device=CPU, world=World(2, 2)).knobs.ep_size == 2


def test_a_gpu_run_is_planned_and_refused_when_nothing_fits():
    run = run_plan("b1", "mod", device=A100, world=World(8, 8))
    assert run.knobs.seq_len == 2048 and run.peak_tflops == 312.0 and run.plan.fits
    assert run.max_steps * run.tokens_per_step >= run.plan.train_tokens
    with pytest.raises(AdaptiveError, match="does not fit 1 x t4-16gb"):
        run_plan("b7", "dense", device=T4)


def test_run_length_comes_from_max_steps_or_tokens():
    assert run_plan(flags=["--max-steps", "7"], device=CPU).max_steps == 7
    assert run_plan(flags=["--tokens", "5120"], device=CPU).max_steps == 10  # 512 tokens per step on a CPU


def test_orchestrator_auto_follows_the_plan():
    assert run_plan("b1", "moe", device=A100, world=World(8, 8)).orchestrator is True  # MoE routing
    short = run_plan("b1", "dense", ["--orchestrator", "auto", "--tokens", "1e8"], device=A100)
    assert short.orchestrator is False and "a single GPU" in short.plan.orchestrator.reason
    assert run_plan("b1", "dense", device=A100).orchestrator is True  # 20B tokens on one GPU: a long run
    assert run_plan("debug", "dense", ["--orchestrator", "on"], device=CPU).orchestrator is True
    assert run_plan("b1", "moe", ["--orchestrator", "off"], device=A100, world=World(8, 8)).orchestrator is False


def test_offload_builds_deepspeeds_cpu_adam_config():
    run = run_plan("b7", "dense", ["--offload", "optimizer"], device=A100, world=World(8, 8))
    zero = run.ds_config["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and run.knobs.offload_optimizer
    assert run.ds_config["zero_force_ds_cpu_optimizer"] is False  # the loop passes DeepSpeedCPUAdam itself
