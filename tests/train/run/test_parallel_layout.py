"""Sequence parallelism (Ulysses), tensor parallelism (AutoTP) and ZeRO++ as a run is sized: the pins reach the
DeepSpeed config under DeepSpeed's own keys, DeepSpeed's `DeepSpeedConfig` accepts every one, and what the
runtime cannot train exactly is refused in one line."""

from __future__ import annotations

import json

import pytest

from adaptive.config.commandline import parse
from adaptive.errors import AdaptiveError
from adaptive.plan import get_gpu
from adaptive.train.run.callbacks import Knobs
from adaptive.train.run.loop import checkpoint_knobs
from adaptive.train.run.runplan import Device, World, check_with_deepspeed, plan_run

CPU = Device("cpu", None)
A100 = Device("cuda", get_gpu("a100-80gb"))
TWO = World(2, 2)


def run_plan(*flags: str, arch: str = "dense", world: World = TWO, device: Device = CPU):
    return plan_run(parse("train", list(flags)), "debug", arch, world, device, {})


def test_sp_size_reaches_deepspeed_as_its_sequence_parallel_size():
    run = run_plan("--sp-size", "2", "--grad-accum", "6")
    assert (run.knobs.sp_size, run.knobs.tp_size) == (2, 1)
    assert run.knobs.gradient_accumulation_steps == 3, "each rank loads 3 micro-batches, its group runs 6"
    cfg = run.ds_config
    assert cfg["sequence_parallel_size"] == 2
    # a rank runs its SP group's micro-batches in turn: DeepSpeed counts sp x the accumulation over world / sp
    assert cfg["gradient_accumulation_steps"] == 6
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * 6 * (2 // 2)
    assert run.tokens_per_step == run.knobs.tokens_per_step * 2  # the same sequences as data parallelism
    check_with_deepspeed(cfg, 2)


def test_grad_accum_under_sp_is_deepspeeds_and_must_be_a_multiple_of_sp():
    with pytest.raises(AdaptiveError, match=r"--grad-accum \(3\) must be a multiple of --sp-size \(2\)"):
        run_plan("--sp-size", "2", "--grad-accum", "3")


def test_tp_size_reaches_deepspeed_as_autotp_size():
    run = run_plan("--tp-size", "2")
    cfg = run.ds_config
    assert cfg["tensor_parallel"] == {"autotp_size": 2}
    assert cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True  # the HF export gathers
    assert run.tokens_per_step == run.knobs.tokens_per_step  # a TP group trains on one copy of the data
    assert "sequence_parallel_size" not in cfg
    check_with_deepspeed(cfg, 2)


def test_zero_plus_plus_switches_reach_the_zero_section_and_deepspeed_accepts_them():
    run = run_plan("--zero", "3", "--zero-hpz", "2", "--zero-quantize", "both", device=A100)
    zero = run.ds_config["zero_optimization"]
    assert (zero["stage"], zero["zero_hpz_partition_size"]) == (3, 2)
    assert zero["zero_quantized_weights"] is True and zero["zero_quantized_gradients"] is True
    check_with_deepspeed(run.ds_config, 2)
    zero = run_plan("--zero", "3", "--zero-quantize", "gradients", device=A100).ds_config["zero_optimization"]
    assert (zero["zero_quantized_weights"], zero["zero_quantized_gradients"]) == (False, True)
    assert "zero_hpz_partition_size" not in run_plan("--zero", "3").ds_config["zero_optimization"]
    assert run_plan("--zero", "3", "--zero-hpz", "2").ds_config["zero_optimization"]["zero_hpz_partition_size"] == 2


def test_quantized_zero_plus_plus_on_a_cpu_is_refused_naming_why():
    """DeepSpeed's CPU op builder has no QuantizerBuilder: qwZ stops in zero.Init, qgZ in the first backward."""
    with pytest.raises(AdaptiveError, match=r"quantized communication \(zero_quantized_weights\) needs DeepSpeed's"):
        run_plan("--zero", "3", "--zero-quantize", "weights")


def test_a_deepspeed_file_pins_them_and_a_contradicting_flag_is_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "sequence_parallel_size": 2,
                                "zero_optimization": {"stage": 3, "zero_quantized_weights": True}}))
    run = run_plan("--ds-config", str(path), device=A100)
    assert run.knobs.sp_size == 2
    assert run.ds_config["zero_optimization"]["zero_quantized_weights"] is True
    with pytest.raises(AdaptiveError, match=r"--sp-size 1 contradicts 2 in"):
        run_plan("--ds-config", str(path), "--sp-size", "1")


@pytest.mark.parametrize("flags, arch, world, message", [
    (("--sp-size", "2"), "mod", TWO, "--sp-size 2 with mod: MoD routes top-k over the whole sequence"),
    (("--sp-size", "2"), "hybrid", TWO, "--sp-size 2 with hybrid"),
    (("--sp-size", "2"), "moe", TWO, "--sp-size 2 with moe: an MoE gate's capacity"),
    (("--tp-size", "2", "--ep-size", "2"), "moe", TWO, r"ep_size \(2\) must divide the data-parallel size 1"),
    (("--sp-size", "2", "--tp-size", "2"), "dense", World(4, 4), "does not compose AutoTP with Ulysses SP"),
    (("--sp-size", "2"), "dense", World(3, 3), r"number of GPUs \(3\) must be divisible by --tp-size x --sp-size \(1 x 2\)"),
    (("--tp-size", "4"), "dense", World(4, 4), r"key-value heads \(2\) must be divisible by --tp-size \(4\)"),
    (("--sp-size", "8"), "dense", World(8, 8), r"attention heads \(4\) must be divisible by --sp-size \(8\)"),
    (("--zero", "2", "--zero-hpz", "2"), "dense", TWO, r"ZeRO\+\+ \(--zero-hpz\) works only with ZeRO-3"),
    (("--zero", "1", "--zero-quantize", "weights"), "dense", TWO, r"ZeRO\+\+ \(qwZ\) works only with ZeRO-3"),
])
def test_what_the_runtime_cannot_train_exactly_is_refused_in_one_line(flags, arch, world, message):
    with pytest.raises(AdaptiveError, match=message) as err:
        run_plan(*flags, arch=arch, world=world, device=A100)
    assert "\n" not in str(err.value)


def test_sp_with_four_kv_heads_divides_or_is_divided():
    """GQA: Ulysses replicates kv heads when sp exceeds them (sp a multiple of kv heads)."""
    from dataclasses import replace

    from adaptive.plan.estimate.parallel import sp_heads_error
    from adaptive.plan.architecture.presets import preset_spec

    spec = preset_spec("debug", "dense")
    assert sp_heads_error(replace(spec, num_attention_heads=8, num_key_value_heads=2), 4) is None
    assert "key-value heads (3) must divide or be divisible by --sp-size (2)" in sp_heads_error(
        replace(spec, num_attention_heads=6, num_key_value_heads=3), 2)


def test_a_resume_with_another_sp_or_tp_size_is_refused_in_one_line(tmp_path):
    ours = run_plan("--sp-size", "2").knobs
    saved = {**ours.as_dict(), "sp_size": 1}
    with pytest.raises(AdaptiveError, match=r"other settings \(sp_size 1 vs 2\); resume with the same ones"):
        checkpoint_knobs(tmp_path, saved, ours)
    saved = {**ours.as_dict(), "sp_size": 1, "tp_size": 2}
    with pytest.raises(AdaptiveError, match=r"sp_size 1 vs 2, tp_size 2 vs 1"):
        checkpoint_knobs(tmp_path, saved, ours)
    assert checkpoint_knobs(tmp_path, ours.as_dict(), ours) == ours
    # a checkpoint written before the fields: sp and tp 1
    old = {k: v for k, v in ours.as_dict().items() if k not in ("sp_size", "tp_size")}
    assert Knobs(**old).sp_size == 1 and Knobs(**old).tp_size == 1


def test_a_pipeline_in_the_deepspeed_file_reaches_the_run_without_a_flag(tmp_path):
    """launch hands the recipe the DeepSpeed config the planner wrote: a pipeline the planner chose (no --pp-size)
    is its `pipeline.stages`, and the run trains that pipeline; a flag that contradicts the file is one line."""
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "pipeline": {"stages": 2}}))
    run = run_plan("--ds-config", str(path))
    assert run.knobs.pp_size == 2
    assert run_plan().knobs.pp_size == 1
    with pytest.raises(AdaptiveError, match=r"^--pp-size 1 contradicts 2 in .*ds_config.json$"):
        run_plan("--ds-config", str(path), "--pp-size", "1")
