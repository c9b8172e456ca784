"""--pp-size 2 --tp-size 2 on four processes (gloo, torchrun): DeepSpeed's pipe x data x model grid, each stage's
decoder linears split over its two TP ranks with DeepSpeed's LinearLayer / LinearAllreduce
(adaptive/models/pipeline_tp.py). Against a pp 1 tp 1 run on one process with the same global batch:

- the same loss and gradient norm step by step within fp32 tolerance (the norm counts each shard once, and each
  whole weight once, or it would differ), and the same evaluation;
- the stages' checkpoints hold half of each block linear per TP rank, and the HF export is their concatenation and
  equals the pp 1 run's weights;
- a resume from the step-3 checkpoint continues bitwise.

The pp 1 run and the pp 2 x tp 2 run start together; the resume follows (three launches in all)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.train._launch import REPO, free_port, launch_env, records, tail

pytestmark = pytest.mark.slow

FLAGS = ["--max-steps", "6", "--seq-len", "32", "--micro-batch", "2", "--grad-accum", "4", "--checkpoint-every", "3",
         "--log-every", "1", "--no-progress", "--orchestrator", "off", "--zero", "1"]
LAYOUT = ["--pp-size", "2", "--tp-size", "2"]
RELATIVE = 1e-5  # fp32: the TP all-reduces and the pipeline sum in another order (measured: 6e-8 and 1e-6)


def start(root: Path, name: str, nproc: int, *extra: str) -> tuple[Path, subprocess.Popen]:
    out = root / name
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                      "--master_port", str(free_port())]
    args = [sys.executable, *launcher, str(REPO / "recipes" / "debug_dense.py"), *FLAGS, "--output-dir", str(out),
            *extra]
    return out, subprocess.Popen(args, cwd=REPO, env=launch_env(root / "home"), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)


def finish(started: tuple[Path, subprocess.Popen]) -> Path:
    out, process = started
    stdout, stderr = process.communicate(timeout=300)
    done = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert done.returncode == 0, tail(done)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pp_tp")
    one, both = start(root, "pp1_tp1", 1), start(root, "pp2_tp2", 4, *LAYOUT)
    out = {"pp1_tp1": finish(one), "pp2_tp2": finish(both)}
    # the pp 2 x tp 2 run stopped after its step-3 checkpoint: its folder cut back to it, resumed
    cut = root / "pp2_tp2_resumed"
    shutil.copytree(out["pp2_tp2"], cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000006")
    (cut / "checkpoints" / "latest").write_text("step_00000003\n")
    shutil.rmtree(cut / "hf")
    out["pp2_tp2_resumed"] = finish(start(root, "pp2_tp2_resumed", 4, *LAYOUT, "--resume"))
    return out


def steps(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in records(run, "train")}


def test_pp2_tp2_trains_with_the_pp1_tp1_losses_and_gradient_norms(runs):
    one, both = steps(runs["pp1_tp1"]), steps(runs["pp2_tp2"])
    assert sorted(one) == sorted(both) == list(range(1, 7))
    for step in one:
        assert both[step]["loss"] == pytest.approx(one[step]["loss"], rel=RELATIVE), step
        assert both[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=RELATIVE), step
    assert one[6]["loss"] < one[1]["loss"]  # it trains
    # the final evaluation: the pipeline's eval schedule, each TP group's tokens counted once
    (eval_one,), (eval_both,) = records(runs["pp1_tp1"], "eval"), records(runs["pp2_tp2"], "eval")
    assert eval_both["eval_loss"] == pytest.approx(eval_one["eval_loss"], rel=RELATIVE)
    assert eval_both["eval_tokens"] == eval_one["eval_tokens"]
    worst = max(abs(both[s]["loss"] / one[s]["loss"] - 1) for s in one)
    print(f"pp2 x tp2 vs pp1 tp1: max relative loss difference over 6 steps = {worst:.3g}")


def test_each_tp_rank_holds_half_of_each_block_linear_and_the_export_is_the_whole(runs):
    export = load_file(runs["pp2_tp2"] / "hf" / "model.safetensors")
    stage = runs["pp2_tp2"] / "checkpoints" / "step_00000006" / "pytorch_model"
    # layer 1 is model.layers.0 (layer 0 is the embedding); its two TP ranks' files
    shards = [torch.load(next(stage.glob(f"layer_01-model_0{r}-*")), weights_only=True) for r in (0, 1)]
    for name, dim in (("self_attn.q_proj", 0), ("self_attn.k_proj", 0), ("mlp.up_proj", 0),
                      ("self_attn.o_proj", 1), ("mlp.down_proj", 1)):
        whole = export[f"model.layers.0.{name}.weight"]
        halves = [s[f"layer.{name}.weight"] for s in shards]
        assert all(h.shape[dim] * 2 == whole.shape[dim] for h in halves), name
        assert not torch.equal(halves[0], halves[1])
        assert torch.equal(torch.cat(halves, dim=dim), whole), name
    norm = [s["layer.input_layernorm.weight"] for s in shards]
    assert torch.equal(norm[0], norm[1]) and torch.equal(norm[0], export["model.layers.0.input_layernorm.weight"])


def test_pp2_tp2_export_holds_the_pp1_tp1_weights(runs):
    one = load_file(runs["pp1_tp1"] / "hf" / "model.safetensors")
    both = load_file(runs["pp2_tp2"] / "hf" / "model.safetensors")
    assert sorted(one) == sorted(both)
    for key in one:
        # Adam normalises each step: a near-zero gradient turns fp32 summation-order rounding into ~1e-6
        torch.testing.assert_close(both[key], one[key], rtol=1e-4, atol=2e-5)
    assert (runs["pp1_tp1"] / "hf" / "config.json").read_text() == (runs["pp2_tp2"] / "hf" / "config.json").read_text()


def test_resume_of_a_pp2_tp2_run_is_exact(runs):
    whole, resumed = steps(runs["pp2_tp2"]), steps(runs["pp2_tp2_resumed"])
    assert [resumed[s]["loss"] for s in (4, 5, 6)] == [whole[s]["loss"] for s in (4, 5, 6)]
    a = load_file(runs["pp2_tp2"] / "hf" / "model.safetensors")
    b = load_file(runs["pp2_tp2_resumed"] / "hf" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
