"""`fit` and `compare` show the predicted loss; `fit --budget-*` answers "which model for this money", as a user
runs them: JSON fields, files that plan again, one-line refusals with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import subprocess_env


def adaptive(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          env=subprocess_env(COLUMNS="200"), timeout=60)


def test_fit_json_and_tables_carry_the_predicted_loss():
    d = json.loads(adaptive("fit", "--model", "b1", "--arch", "moe", "--gpu", "h100-80gb", "--json").stdout)
    q = d["quality"]
    assert {"predicted_loss", "band", "law", "source", "perplexity", "notes"} <= set(q)
    assert q["band"][0] < q["predicted_loss"] < q["band"][1]
    assert "ludziejewski2025" in q["law"] and "arXiv 2502.05172" in q["source"]
    assert d["hyperparameters"]["offered_lr"] > 0 and "DeepSeek" in d["hyperparameters"]["source"]
    out = adaptive("fit", "--model", "b1", "--gpu", "h100-80gb", "--loss-law", "chinchilla").stdout
    assert "Quality (predicted final loss)" in out and "Hoffmann et al. 2022" in out


def test_dataset_tokens_discount_repeats_in_the_prediction():
    base = ("fit", "--model", "b1", "--gpu", "h100-80gb", "--tokens", "20e9", "--json")
    fresh = json.loads(adaptive(*base).stdout)["quality"]
    repeated = json.loads(adaptive(*base, "--dataset-tokens", "2e9").stdout)["quality"]
    assert repeated["epochs"] == pytest.approx(10) and repeated["predicted_loss"] > fresh["predicted_loss"]


def test_compare_ranks_quality_by_predicted_loss_and_computes_each_winner():
    rows = json.loads(adaptive("compare", "--model", "b1,b7", "--arch", "dense,moe", "--gpu", "h100-80gb",
                               "--tokens", "20e9", "--json").stdout)
    fitting = [r for r in rows if r["fits"]]
    assert [r["best_quality"] for r in rows].count(True) == 1
    assert min(fitting, key=lambda r: r["predicted_loss"])["best_quality"]
    cheapest = min(fitting, key=lambda r: r["cost_usd"])
    assert cheapest["cheapest"]
    value = [r for r in rows if r["best_loss_per_dollar"]]
    assert len(value) == 1
    gain = lambda r: (cheapest["predicted_loss"] - r["predicted_loss"]) / (r["cost_usd"] - cheapest["cost_usd"])  # noqa: E731
    better = [r for r in fitting if r["predicted_loss"] < cheapest["predicted_loss"]]
    assert value[0] is max(better, key=gain) if better else value[0] is cheapest


def test_a_budget_returns_the_best_plan_the_runners_up_and_files_that_plan_again(tmp_path):
    start = time.perf_counter()
    r = adaptive("fit", "--budget-usd", "2000", "--gpu", "a100-80gb", "--gpus", "8", "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert time.perf_counter() - start < 10  # the benchmark measures it properly (under a second)
    d = json.loads(r.stdout)
    runners = d["budget"]["best_per_arch"]
    assert sorted(x["arch"] for x in runners) == ["dense", "hybrid", "mod", "moe"]
    assert runners[0]["model"] == d["model"] and runners[0]["predicted_loss"] == d["quality"]["predicted_loss"]
    assert all(x["cost_usd"] == pytest.approx(2000, rel=1e-6) for x in runners)
    assert json.loads((tmp_path / "plan.json").read_text())["budget"]["usd"] == 2000
    # the winner's shape, as config.json, plans again with the same parameter count
    again = json.loads(adaptive("fit", "--model", str(tmp_path / "config.json"), "--gpu", "a100-80gb", "--gpus", "8",
                                "--json").stdout)
    assert (again["params_total"], again["arch"]) == (d["params_total"], d["arch"])
    assert (tmp_path / "ds_config.json").exists() and (tmp_path / "accelerate_config.yaml").exists()


def test_a_given_model_asks_how_many_tokens_the_budget_buys_it():
    d = json.loads(adaptive("fit", "--model", "b1", "--arch", "dense", "--budget-gpu-hours", "64", "--gpu",
                            "h100-80gb", "--gpus", "8", "--json").stdout)
    assert d["model"] == "b1" and [x["model"] for x in d["budget"]["best_per_arch"]] == ["b1"]
    assert d["train_hours"] == pytest.approx(8) and d["train_tokens"] == pytest.approx(
        d["tokens_per_second"] * 8 * 3600)


@pytest.mark.parametrize("args,message", [
    (["--budget-usd", "-5"], "--budget-usd must be positive, got -5"),
    (["--budget-usd", "nan"], "--budget-usd must be a finite number"),
    (["--budget-days", "0"], "--budget-days must be positive"),
    (["--max-params", "1e9"], "--max-params bounds a budget search"),
    (["--budget-usd", "0.0001"], "buys no model"),
    (["--loss-law", "chinchila"], "unknown --loss-law 'chinchila'; did you mean chinchilla?"),
    (["--loss-law", "nowhere/law.json"], "no such file"),
])
def test_bad_quality_and_budget_input_is_one_line_and_exit_2(args, message):
    r = adaptive("fit", "--gpu", "a100-80gb", "--gpus", "8", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
