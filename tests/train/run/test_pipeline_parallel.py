"""--pp-size on DeepSpeed's pipeline engine, end to end on the CPU (gloo, torchrun): the debug dense and MoE
recipes train with the losses of a pp 1 run step by step; pp 2 x dp 2 on four processes matches dp 2 pp 1 on two
(the same replicas draw the same data; each pipeline only splits its replica's layers); a resume from a pp 2
checkpoint continues bitwise; the HF export of a pp 2 run holds the pp 1 run's weights.

The runs are few steps of the debug model at sequence 32, shared by the assertions (module-scoped)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.train._launch import REPO, free_port, launch_env, tail, train_losses

pytestmark = pytest.mark.slow

FLAGS = ["--max-steps", "6", "--seq-len", "32", "--micro-batch", "2", "--grad-accum", "4", "--checkpoint-every", "3",
         "--log-every", "1", "--no-progress", "--orchestrator", "off", "--zero", "0"]
RELATIVE = 1e-5  # fp32: the pipeline sums its micro-batch losses in another order


def train(root: Path, name: str, arch: str, nproc: int, *extra: str) -> Path:
    out = root / name
    recipe = REPO / "recipes" / f"debug_{arch}.py"
    args = [str(recipe), *FLAGS, "--output-dir", str(out), *extra]
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                      "--master_port", str(free_port())]
    done = subprocess.run([sys.executable, *launcher, *args], cwd=REPO, env=launch_env(root / "home"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, tail(done)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pp")
    out = {
        "dense_pp1": train(root, "dense_pp1", "dense", 1),
        "dense_pp2": train(root, "dense_pp2", "dense", 2, "--pp-size", "2"),
        "moe_pp1": train(root, "moe_pp1", "moe", 1),
        "moe_pp2": train(root, "moe_pp2", "moe", 2, "--pp-size", "2"),
        "dense_dp2": train(root, "dense_dp2", "dense", 2),
        "dense_pp2_dp2": train(root, "dense_pp2_dp2", "dense", 4, "--pp-size", "2"),
    }
    # a pp 2 run stopped after its step-3 checkpoint: the uninterrupted run's folder cut back to it, resumed
    cut = root / "dense_pp2_resumed"
    shutil.copytree(out["dense_pp2"], cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000006")
    (cut / "checkpoints" / "latest").write_text("step_00000003\n")
    shutil.rmtree(cut / "hf")
    out["dense_pp2_resumed"] = train(root, "dense_pp2_resumed", "dense", 2, "--pp-size", "2", "--resume")
    return out


def assert_same_losses(a: Path, b: Path, steps: range = range(1, 7)) -> None:
    la, lb = train_losses(a), train_losses(b)
    assert sorted(la) == sorted(lb) == list(steps)
    for step in steps:
        assert lb[step] == pytest.approx(la[step], rel=RELATIVE), (step, la[step], lb[step])
    assert la[steps[-1]] < la[steps[0]]  # it trains


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_pp2_trains_with_the_pp1_losses(runs, arch):
    assert_same_losses(runs[f"{arch}_pp1"], runs[f"{arch}_pp2"])


def test_moe_router_loss_crosses_the_stages(runs):
    one = {r["step"]: r for r in map(json.loads, (runs["moe_pp1"] / "metrics.jsonl").read_text().splitlines())
           if r["kind"] == "train"}
    two = {r["step"]: r for r in map(json.loads, (runs["moe_pp2"] / "metrics.jsonl").read_text().splitlines())
           if r["kind"] == "train"}
    for step in one:
        assert two[step]["aux_loss"] > 0
        assert two[step]["aux_loss"] == pytest.approx(one[step]["aux_loss"], rel=RELATIVE)
        assert two[step]["lm_loss"] == pytest.approx(one[step]["lm_loss"], rel=RELATIVE)


def test_pp2_by_dp2_on_four_processes_matches_dp2(runs):
    assert_same_losses(runs["dense_dp2"], runs["dense_pp2_dp2"])
    # and not the one-replica run: the four processes trained on two replicas' data
    assert train_losses(runs["dense_pp2_dp2"])[6] != pytest.approx(train_losses(runs["dense_pp2"])[6], rel=1e-4)


def test_resume_of_a_pp2_run_is_exact(runs):
    whole, resumed = train_losses(runs["dense_pp2"]), train_losses(runs["dense_pp2_resumed"])
    assert [resumed[s] for s in (4, 5, 6)] == [whole[s] for s in (4, 5, 6)]


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_pp2_export_holds_the_pp1_weights(runs, arch):
    one = load_file(runs[f"{arch}_pp1"] / "hf" / "model.safetensors")
    two = load_file(runs[f"{arch}_pp2"] / "hf" / "model.safetensors")
    assert sorted(one) == sorted(two)
    for key in one:
        # Adam normalises each step: a near-zero gradient turns fp32 summation-order rounding into ~5e-6
        torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=2e-5)
    first = json.loads((runs[f"{arch}_pp1"] / "hf" / "config.json").read_text())
    second = json.loads((runs[f"{arch}_pp2"] / "hf" / "config.json").read_text())
    assert first["architectures"] == second["architectures"]
