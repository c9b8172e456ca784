"""--pp-size on DeepSpeed's pipeline engine, end to end on the CPU (gloo): the debug dense and MoE recipes train with
the losses of a pp 1 run step by step; pp 2 x dp 2 x ep 2 on four processes matches dp 2 x ep 2 on two (the same
replicas draw the same data; each pipeline only splits its replica's layers, each stage's experts are split over
its replicas); a pp 2 run SIGKILLed after a checkpoint resumes bitwise; the HF export of a pp 2 run holds the pp 1
run's weights; the orchestrator's router statistics and events are those of the pp 1 run.

Eight launches of four steps of the debug model at sequence 32, shared by the assertions (module-scoped) and run
two at a time: the uninterrupted dense pp 2 run through `adaptive launch` (accelerate launch --use_deepspeed), the
killed one through accelerate launch with the test driver's SIGKILL callback, the rest through torchrun or one
plain process. The four-process pair starts from the MoE pp 1 run's export with tied embeddings (--init-from): a
pipeline whose first and last stages share the embedding (TiedLayerSpec)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.train._launch import REPO, accelerate_launch, driver, free_port, launch_env, records, tail

pytestmark = pytest.mark.slow

STEPS = 4
FLAGS = ["--max-steps", str(STEPS), "--seq-len", "32", "--micro-batch", "2", "--grad-accum", "4",
         "--checkpoint-every", "2", "--log-every", "1", "--no-progress", "--zero", "0"]
RELATIVE = 1e-5  # fp32: the pipeline sums its micro-batch losses in another order


def recipe(arch: str) -> Path:
    return REPO / "recipes" / f"debug_{arch}.py"


def torchrun(root: Path, arch: str, nproc: int, out: Path, *extra: str) -> subprocess.CompletedProcess:
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                      "--master_port", str(free_port())]
    return subprocess.run([sys.executable, *launcher, str(recipe(arch)), *FLAGS, "--output-dir", str(out), *extra],
                          cwd=REPO, env=launch_env(root / "home"), capture_output=True, text=True, timeout=600)


def adaptive_launch(root: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "launch", str(recipe("dense")), "--gpus", "2", *FLAGS,
                           "--orchestrator", "off", "--output-dir", str(out), *extra], cwd=REPO,
                          env=launch_env(root / "home"), capture_output=True, text=True, timeout=600)


def tied_copy(export: Path, target: Path) -> Path:
    """`export` with tied embeddings: the head is the embedding (config.json says so, lm_head.weight goes)."""
    shutil.copytree(export, target)
    config = json.loads((target / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (target / "config.json").write_text(json.dumps(config))
    weights = load_file(target / "model.safetensors")
    weights.pop("lm_head.weight")
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pp")
    out = {name: root / name for name in ("dense_pp1", "dense_pp2", "killed", "moe_pp1", "moe_pp2", "moe_dp2_ep2",
                                          "moe_pp2_dp2_ep2", "tied_init")}
    done: dict[str, subprocess.CompletedProcess] = {}
    pp2, ep2 = ("--pp-size", "2"), ("--ep-size", "2", "--orchestrator", "on")

    def kill_and_resume():
        # SIGKILL on every rank right after the step-2 checkpoint is complete (tests/train/_driver.py), then --resume
        args = [*FLAGS, "--orchestrator", "off", *pp2, "--output-dir", str(out["killed"])]
        done["killed"] = driver("debug", "dense", {"kill_after_checkpoint": 2}, args, nproc=2, home=root / "home")
        done["resumed"] = accelerate_launch(recipe("dense"), [*args, "--resume"], nproc=2, home=root / "home")

    def moe_runs():
        done["moe_pp1"] = torchrun(root, "moe", 1, out["moe_pp1"], "--orchestrator", "on")
        assert done["moe_pp1"].returncode == 0, tail(done["moe_pp1"])
        init = ("--init-from", str(tied_copy(out["moe_pp1"] / "hf", out["tied_init"])))
        with ThreadPoolExecutor(2) as pool:
            four = pool.submit(torchrun, root, "moe", 4, out["moe_pp2_dp2_ep2"], *pp2, *ep2, *init)
            done["moe_dp2_ep2"] = torchrun(root, "moe", 2, out["moe_dp2_ep2"], *ep2, *init)
            done["moe_pp2_dp2_ep2"] = four.result()

    jobs = {
        "kill_and_resume": kill_and_resume,
        "moe": moe_runs,
        "dense_pp1": lambda: done.setdefault("dense_pp1", torchrun(root, "dense", 1, out["dense_pp1"],
                                                                   "--orchestrator", "off")),
        "dense_pp2": lambda: done.setdefault("dense_pp2", adaptive_launch(root, out["dense_pp2"], *pp2)),
        "moe_pp2": lambda: done.setdefault("moe_pp2", torchrun(root, "moe", 2, out["moe_pp2"], "--orchestrator", "on",
                                                               *pp2)),
    }
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(job) for job in jobs.values()]:
            future.result()
    for name, result in done.items():
        if name != "killed":
            assert result.returncode == 0, (name, tail(result))
    out["done"] = done
    return out


def assert_same_losses(a: Path, b: Path) -> float:
    ra, rb = records(a, "train"), records(b, "train")
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(1, STEPS + 1))
    for x, y in zip(ra, rb):
        assert y["tokens_seen"] == x["tokens_seen"]
        assert y["loss"] == pytest.approx(x["loss"], rel=RELATIVE), (x["step"], x["loss"], y["loss"])
    assert ra[-1]["loss"] < ra[0]["loss"]  # it trains
    return max(abs(x["loss"] - y["loss"]) for x, y in zip(ra, rb))


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_pp2_trains_with_the_pp1_losses(runs, arch):
    worst = assert_same_losses(runs[f"{arch}_pp1"], runs[f"{arch}_pp2"])
    for a, b in zip(records(runs[f"{arch}_pp1"], "train"), records(runs[f"{arch}_pp2"], "train")):
        # the gradients too (AdamW would hide a constant factor in the losses): DeepSpeed's clipping norm over the
        # stages against the loop's own norm of one whole model
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=RELATIVE), (a["step"], a["grad_norm"], b["grad_norm"])
    print(f"{arch} pp2 vs pp1: max |loss difference| over {STEPS} steps = {worst:.3g}")


def test_adaptive_launch_trains_the_pp2_run(runs):
    out = runs["done"]["dense_pp2"].stdout
    assert "accelerate launch --config_file" in out and "--pp-size 2" in out
    start = records(runs["dense_pp2"], "start")[0]
    assert start["world_size"] == 2 and start["knobs"]["pp_size"] == 2


def test_moe_router_statistics_and_events_match_pp1(runs):
    """The stages' per-layer router statistics reach metrics.jsonl and the orchestrator (balance, capacity) as a
    pp 1 run's: every MoE layer's expert counts, each held by one stage."""
    one, two = records(runs["moe_pp1"], "train"), records(runs["moe_pp2"], "train")
    layers = len(one[0]["expert_counts"])
    assert layers > 2  # both stages hold MoE layers
    for a, b in zip(one, two):
        assert b["aux_loss"] > 0 and b["aux_loss"] == pytest.approx(a["aux_loss"], rel=RELATIVE)
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=RELATIVE)
        assert b["expert_counts"] == a["expert_counts"]  # integers: exact
        assert sum(map(sum, b["expert_counts"])) == layers * 8 * 32 * 2  # 8 sequences of 32 tokens, top-2
        assert b["dropped_fraction"] == pytest.approx(a["dropped_fraction"], abs=1e-12)
        assert b["max_vio"] == pytest.approx(a["max_vio"], abs=1e-12)

    def events(run: Path) -> list[tuple]:
        lines = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
        return [(e.get("step"), e.get("policy"), e.get("action"), e.get("signals"), e.get("after")) for e in lines
                if e.get("policy") in ("balance", "capacity")]

    first, second = events(runs["moe_pp1"]), events(runs["moe_pp2"])
    assert [e[:3] for e in first] == [e[:3] for e in second] and len(first) >= STEPS  # a bias update every step
    for a, b in zip(first, second):
        for name in ("max_vio", "dropped_fraction", "dead_experts"):
            if name in a[3]:
                assert b[3][name] == pytest.approx(a[3][name], abs=1e-12), name
        # the same bias updates (signs of exact integer loads), every layer's gathered from its stage
        assert b[4] == a[4] and (a[1] != "balance" or len(b[4]["bias_range"]) == layers)
    summaries = [[e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
                  if e.get("kind") == "summary"] for run in (runs["moe_pp1"], runs["moe_pp2"])]
    assert summaries[0][-1]["balance"] == summaries[1][-1]["balance"]  # the final biases of every layer


def test_pp2_by_dp2_by_ep2_on_four_processes_matches_dp2_by_ep2(runs):
    worst = assert_same_losses(runs["moe_dp2_ep2"], runs["moe_pp2_dp2_ep2"])
    print(f"moe pp2 x dp2 x ep2 vs dp2 x ep2: max |loss difference| = {worst:.3g}")
    one, four = records(runs["moe_dp2_ep2"], "train"), records(runs["moe_pp2_dp2_ep2"], "train")
    assert [r["expert_counts"] for r in one] == [r["expert_counts"] for r in four]
    start = records(runs["moe_pp2_dp2_ep2"], "start")[0]
    assert (start["world_size"], start["knobs"]["pp_size"], start["knobs"]["ep_size"]) == (4, 2, 2)


def test_init_from_loads_into_a_pipeline_with_tied_embeddings(runs):
    """Both the four- and the two-process run started from the tied copy of the MoE pp 1 export: each weight ends
    within four Adam steps of it (at most 6e-3 of learning rate in all; a fresh init differs by ~0.1), and the
    exports keep the head tied to the embedding."""
    init = load_file(runs["tied_init"] / "model.safetensors")
    assert "--init-from" in runs["done"]["moe_pp2_dp2_ep2"].stderr and "tensors loaded" in \
        runs["done"]["moe_pp2_dp2_ep2"].stderr
    one = load_file(runs["moe_dp2_ep2"] / "hf" / "model.safetensors")
    four = load_file(runs["moe_pp2_dp2_ep2"] / "hf" / "model.safetensors")
    assert sorted(one) == sorted(four) == sorted(init) and "lm_head.weight" not in four
    assert any("experts" in key for key in four)  # both stages' experts, gathered over the replicas
    for key in one:
        torch.testing.assert_close(four[key], one[key], rtol=1e-4, atol=2e-5)
        assert (four[key] - init[key]).abs().max() < 0.012, key
    for name in ("moe_dp2_ep2", "moe_pp2_dp2_ep2"):
        assert json.loads((runs[name] / "hf" / "config.json").read_text())["tie_word_embeddings"] is True


def test_a_killed_pp2_run_resumes_bitwise(runs):
    done = runs["done"]
    assert done["killed"].returncode != 0 and "SIGKILL" in tail(done["killed"], 20000)
    saved = json.loads((runs["killed"] / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    assert saved["step"] == 2 and saved["samples_seen"] == [2 * 8, 2 * 8]  # both stages read the same samples
    starts = records(runs["killed"], "start")
    assert [s["step"] for s in starts] == [0, 2] and starts[1]["resumed_from"].endswith("step_00000002")
    whole, resumed = records(runs["dense_pp2"], "train"), records(runs["killed"], "train")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert [(r["loss"], r["lr"], r["tokens_seen"]) for r in resumed] == \
           [(r["loss"], r["lr"], r["tokens_seen"]) for r in whole]  # bitwise
    assert records(runs["killed"], "eval")[-1]["eval_loss"] == records(runs["dense_pp2"], "eval")[-1]["eval_loss"]


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
