"""Ulysses sequence parallelism and AutoTP tensor parallelism train the same model, step by step, on the CPU
(gloo, two processes under accelerate launch, the debug dense recipe with a recording callback):

- `--sp-size 2` against data parallelism on the same two processes: the same sequences per step, so the same
  losses, gradient norms and eval loss within fp32 rounding; each rank saw half of every sequence, and
  DeepSpeed's Ulysses attention stood in for sdpa.
- `--tp-size 2` on two processes against one process, both ZeRO-3 from one saved model: a TP group trains on one
  copy of the data; AutoTP sharded the attention and MLP projections (column- and row-parallel), and the
  losses match.
- the same with the debug MoE recipe on DeepSpeed-MoE: the experts are sharded too (expert tensor parallelism);
  the final export gathers to the same weights.
- a run killed after a checkpoint resumes exactly, and only with the same layout.

The four-process layouts (ZeRO++ hpZ, tp 2 x ep 2) are in test_four_rank_layouts.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.train._launch import accelerate_launch, records, tail

pytestmark = pytest.mark.slow  # two-process DeepSpeed runs

DRIVER = Path(__file__).parents[1] / "_parallel_driver.py"
STEPS = 4
COMMON = ("--max-steps", str(STEPS), "--log-every", "1", "--no-progress", "--seq-len", "64", "--micro-batch", "2",
          "--grad-accum", "2")
FP32 = 1e-5  # a sum of 256 token losses in fp32, reordered by the all-to-alls and all-reduces


def run(tmp_path: Path, name: str, nproc: int, *flags: str, arch: str = "dense") -> tuple[dict[int, dict], list[dict]]:
    out = tmp_path / name
    done = accelerate_launch(DRIVER, [str(out / "rec"), arch, "--", *COMMON, "--output-dir", str(out / "run"), *flags],
                             nproc=nproc, home=tmp_path / "home", timeout=600)
    assert done.returncode == 0, tail(done)
    ranks = {r: json.loads((out / "rec" / f"rank{r}.json").read_text()) for r in range(nproc)}
    return ranks, records(out / "run")


def assert_same_training(base: list[dict], other: list[dict]) -> float:
    train = [(a, b) for a, b in zip(base, other) if a["kind"] == "train"]
    assert [a["step"] for a, _ in train] == list(range(1, STEPS + 1))
    assert all(b["step"] == a["step"] and b["tokens_seen"] == a["tokens_seen"] for a, b in train)
    worst = max(abs(a["loss"] - b["loss"]) for a, b in train)
    assert worst < FP32, [(a["loss"], b["loss"]) for a, b in train]
    for a, b in train:  # the gradients too: AdamW would hide a constant factor in the losses
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    evals = [(a["eval_loss"], b["eval_loss"]) for a, b in zip(base, other) if a["kind"] == "eval"]
    assert evals and all(abs(a - b) < FP32 for a, b in evals), evals
    return worst


@pytest.mark.parametrize("zero", [None, "3"])
def test_sp_size_2_trains_as_sp_size_1_step_by_step(tmp_path, zero):
    # the planner's stage, and ZeRO-3, whose reduce-scatter divides by the whole world (engine.ulysses_gradient_scale)
    pin = ("--zero", zero) if zero else ()
    dp, dp_records = run(tmp_path, "sp1", 2, *pin)
    # --grad-accum is DeepSpeed's gradient_accumulation_steps: an SP group's micro-steps, one per rank's micro-batch
    sp, sp_records = run(tmp_path, "sp2", 2, "--sp-size", "2", "--grad-accum", "4", *pin)
    worst = assert_same_training(dp_records, sp_records)
    for rank in (0, 1):
        r = sp[rank]
        assert r["sdpa"].startswith("UlyssesSPAttentionHF"), r["sdpa"]  # DeepSpeed's attention stood in for sdpa
        # 2 micro-batches x 2 SP ranks per step, each rank holding half of every sequence, labels shifted first
        assert len(r["batches"]) == STEPS * 2 * 2
        assert all(b == {"input_ids": [2, 32], "position_ids": [2, 32], "shift_labels": [2, 32]} for b in r["batches"])
        assert len(dp[rank]["batches"]) == STEPS * 2 and dp[rank]["sdpa"] == "sdpa_attention_forward"
    # the loss each rank logs per micro-batch is the whole sequence's: the same on both ranks of the group
    assert sp[0]["losses"] == pytest.approx(sp[1]["losses"], abs=1e-6)
    print(f"sp2 vs sp1: max |loss difference| over {STEPS} steps = {worst:.3g}")


def test_tp_size_2_trains_as_tp_size_1_step_by_step(tmp_path):
    # ZeRO-3 on both, from one saved model (--init-from): zero.Init would build the TP shards with another random
    # stream than one whole model, so a fresh init would start the runs from different weights
    import torch

    from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM

    torch.manual_seed(0)
    AdaptiveForCausalLM(AdaptiveConfig.from_preset("debug")).save_pretrained(tmp_path / "init")
    start = ("--zero", "3", "--init-from", str(tmp_path / "init"))
    one, one_records = run(tmp_path, "tp1", 1, *start)
    tp, tp_records = run(tmp_path, "tp2", 2, "--tp-size", "2", *start)
    worst = assert_same_training(one_records, tp_records)
    assert one[0]["q_proj"] == "Linear" and one[0]["q_proj_shape"] == [64, 64]
    for rank in (0, 1):
        r = tp[rank]
        # AutoTP, from the config's tp_plan: q/k/v and gate/up column-parallel, o and down row-parallel
        assert (r["q_proj"], r["q_proj_shape"]) == ("LinearLayer", [32, 64])
        assert (r["down_proj"], r["down_proj_shape"]) == ("LinearAllreduce", [64, 96])
        assert r["lm_head"] == "LinearLayer" and r["dp_world_size"] == 1  # the head too, its logits gathered
        assert r["losses"] == pytest.approx(one[0]["losses"], abs=FP32)  # both ranks trained on the same data
    print(f"tp2 vs tp1: max |loss difference| over {STEPS} steps = {worst:.3g}")


def exported_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(next((run_dir / "hf").glob("*.safetensors")))


def test_tp_size_2_shards_deepspeed_moe_experts_and_trains_as_tp_size_1(tmp_path):
    """Expert tensor parallelism: DeepSpeed-MoE's experts are AutoTP-sharded like the dense MLP (the config's
    tp_plan), MOELayer hands each TP rank its share of every expert's capacity, and the run trains as tp 1."""
    one, one_records = run(tmp_path, "tp1", 1, "--zero", "2", arch="moe")
    tp, tp_records = run(tmp_path, "tp2", 2, "--tp-size", "2", "--zero", "2", arch="moe")
    worst = assert_same_training(one_records, tp_records)
    assert (one[0]["expert_up_proj"], one[0]["expert_up_proj_shape"]) == ("Linear", [192, 64])
    for rank in (0, 1):
        r = tp[rank]
        assert (r["expert_up_proj"], r["expert_up_proj_shape"]) == ("LinearLayer", [96, 64])  # column-parallel
        assert (r["expert_down_proj"], r["expert_down_proj_shape"]) == ("LinearAllreduce", [64, 96])  # row
        assert (r["q_proj"], r["q_proj_shape"]) == ("LinearLayer", [32, 64]) and r["local_experts"] == 8
    # the final export gathers the shards: the same model as tp 1's, to fp32 rounding
    whole, gathered = exported_weights(tmp_path / "tp1" / "run"), exported_weights(tmp_path / "tp2" / "run")
    assert whole.keys() == gathered.keys()
    assert max((whole[k] - gathered[k]).abs().max().item() for k in whole) < 1e-5
    print(f"MoE tp2 vs tp1: max |loss difference| over {STEPS} steps = {worst:.3g}")


# AutoTP's resume is checked on the MoE model, whose attention projections are sharded as the dense model's are
@pytest.mark.parametrize(("arch", "flags"), [("dense", ("--sp-size", "2")), ("moe", ("--tp-size", "2"))],
                         ids=["sp2", "tp2-moe"])
def test_a_run_killed_after_a_checkpoint_resumes_exactly_and_only_with_the_same_layout(arch, flags, tmp_path):
    from tests.train._launch import driver, train_losses

    common = ["--max-steps", "4", "--log-every", "1", "--no-progress", "--seq-len", "64", "--micro-batch", "2",
              "--checkpoint-every", "2", "--zero", "2", *flags]
    home = tmp_path / "home"
    full = driver("debug", arch, {}, ["--output-dir", str(tmp_path / "full"), *common], nproc=2, home=home)
    assert full.returncode == 0, tail(full)
    cut = driver("debug", arch, {"kill_after_checkpoint": 2}, ["--output-dir", str(tmp_path / "cut"), *common],
                 nproc=2, home=home)
    assert cut.returncode != 0
    other = driver("debug", arch, {}, ["--output-dir", str(tmp_path / "cut"), *common[:-2], "--resume"],
                   nproc=2, home=home)
    assert other.returncode != 0
    assert f"was trained with other settings ({flags[0][2:4]}_size 2 vs 1); resume with the same ones" in tail(other)
    resumed = driver("debug", arch, {}, ["--output-dir", str(tmp_path / "cut"), *common, "--resume"], nproc=2,
                     home=home)
    assert resumed.returncode == 0, tail(resumed)
    want, got = train_losses(tmp_path / "full"), train_losses(tmp_path / "cut")
    assert sorted(got) == [1, 2, 3, 4]
    assert all(abs(got[step] - want[step]) < FP32 for step in (3, 4)), (want, got)
