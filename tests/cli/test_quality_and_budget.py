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


def _joint_law(tmp_path, moe: float, spread: float) -> str:
    """A law.json of the joint form: dense the reference, MoE at `moe`x its parameters, refits spread by `spread`."""
    from adaptive.plan.quality.law_file import arch_dict, file_dict, law_dict, refit_dict

    shared = (1.8, 400.0, 900.0, 0.34, 0.3)
    refits = [refit_dict(shared, {"dense": 1.0, "moe": moe * (1 + spread * (i - 10) / 10)}) for i in range(21)]
    archs = {a: arch_dict(k, (1e8, 1e10), (1e9, 1e12), 9) for a, k in (("dense", 1.0), ("moe", moe))}
    path = tmp_path / "law.json"
    path.write_text(json.dumps(file_dict("mine", "test sweep", "test corpus", "dense",
                                         law_dict(shared, "active", 18, 0.01), archs, refits)))
    return str(path)


@pytest.mark.parametrize("moe, spread, tie", [(1.05, 0.5, True), (3.0, 0.1, False)])
def test_compare_and_the_budget_search_call_a_tie_under_a_joint_law(tmp_path, moe, spread, tie):
    """Same shape as dense and MoE (b1's active parameters): with the MoE's multiplier's band holding 1 the pair is a
    tie, said in words; with it well above 1, MoE is lower and nothing ties."""
    law = _joint_law(tmp_path, moe, spread)
    rows = json.loads(adaptive("compare", "--model", "b1", "--arch", "dense,moe", "--gpu", "h100-80gb", "--tokens",
                               "20e9", "--loss-law", law, "--json").stdout)
    moe_row = next(r for r in rows if r["arch"] == "moe")
    dense_row = next(r for r in rows if r["arch"] == "dense")
    assert moe_row["predicted_loss"] < dense_row["predicted_loss"]  # k > 1 either way
    assert moe_row["best_quality"] and dense_row["ties_best_quality"] is tie
    assert (dense_row["quality_tie"] is not None) is tie
    shown = adaptive("compare", "--model", "b1", "--arch", "dense,moe", "--gpu", "h100-80gb", "--tokens", "20e9",
                     "--loss-law", law).stdout
    assert ("loss (tie): b1 moe and b1 dense tie" in shown) is tie
    fit = json.loads(adaptive("fit", "--model", "b1", "--arch", "moe", "--gpu", "h100-80gb", "--loss-law", law,
                              "--json").stdout)["quality"]
    assert any(("a tie with dense" if tie else "separated from dense") in n for n in fit["notes"])
    budget = json.loads(adaptive("fit", "--budget-usd", "3000", "--gpu", "h100-80gb", "--loss-law", law,
                                 "--json").stdout)["budget"]
    assert len(budget["versus_best"]) == 3  # the best arch against the other three
    for versus in budget["versus_best"]:  # paired refits of one law decide each, not the bands
        assert versus["gap_band"] is not None and versus["tie"] is (versus["gap_band"][0] <= 0)


def test_a_law_file_of_the_old_per_arch_form_is_one_line_and_exit_2(tmp_path):
    old = tmp_path / "law.json"
    old.write_text(json.dumps({"format": "adaptive-loss-law", "version": 1, "name": "x", "source": "s",
                               "fitted_on": "f", "laws": {"dense": {"E": 1.8, "A": 400.0, "B": 900.0, "alpha": 0.34,
                                                                    "beta": 0.3, "params_range": [1e8, 1e10],
                                                                    "tokens_range": [1e9, 1e12]}}}))
    done = adaptive("fit", "--model", "b1", "--gpu", "h100-80gb", "--loss-law", str(old))
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "version-1 file of separate per-arch laws" in done.stderr and "rerun `adaptive scale`" in done.stderr
