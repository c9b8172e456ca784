"""Numbers with units (--tokens 20B, --host-mem 256GB), a percent given as a fraction, a bare `adaptive` and a
budget winner's name, as a user types them."""

import json
import subprocess
import sys

import pytest

from tests.conftest import subprocess_env


def adaptive(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          env=subprocess_env(COLUMNS="200"), timeout=60)


def fit_json(*args: str) -> dict:
    r = adaptive("fit", "--model", "b1", "--gpu", "t4", *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def refused(*args: str) -> str:
    """The one line a bad value gets (exit code 2, no traceback)."""
    r = adaptive(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


@pytest.mark.parametrize("text, tokens", [("20B", 20e9), ("1.5T", 1.5e12), ("500M", 500e6), ("2e9", 2e9),
                                          ("750k", 750e3), ("12000000000", 12e9)])
def test_token_counts_take_decimal_suffixes(text, tokens):
    assert fit_json("--tokens", text)["train_tokens"] == pytest.approx(tokens)


@pytest.mark.parametrize("text, nbytes", [("256GB", 256e9), ("256GiB", 256 * 2**30), ("1TiB", 2**40), ("2TB", 2e12),
                                          ("100", 100 * 2**30)])  # a plain number is GiB, as before
def test_host_memory_takes_decimal_and_binary_units(text, nbytes):
    assert fit_json("--host-mem", text)["host_capacity_bytes"] == pytest.approx(nbytes, abs=1)


def test_a_whole_number_option_takes_a_suffix_and_refuses_a_fraction_of_one():
    # the plan rounds the batch to whole sequences of micro-batches
    assert fit_json("--global-batch-tokens", "4M")["global_batch_tokens"] == pytest.approx(4e6, rel=0.01)
    line = refused("fit", "--model", "b1", "--gpu", "t4", "--global-batch-tokens", "1.5")
    assert "'1.5' is not a whole number; did you mean 2?" in line


def test_compare_takes_token_counts_with_units_too():
    r = adaptive("compare", "--model", "b1", "--arch", "dense", "--gpu", "a100", "--tokens", "30B", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["train_tokens"] == pytest.approx(30e9)


@pytest.mark.parametrize("args, says", [
    (("--tokens", "20G"), "--tokens '20G': unknown unit 'G'"),
    (("--tokens", "20BB"), "did you mean 20B?"),
    (("--tokens", "lots"), "--tokens 'lots' is not a count"),
    (("--host-mem", "256G"), "did you mean 256GB?"),
    (("--host-mem", "256 gigs"), "unknown unit 'gigs', it takes GiB: a number or one with GB, TB (1e9, 1e12 bytes), "
                                 "MiB, GiB or TiB; did you mean 256GiB?"),
    (("--host-mem", "lots"), "--host-mem 'lots' is not GiB"),
    (("--tokens", "-5B"), "--tokens must be positive, got -5e+09"),
])
def test_a_malformed_number_is_one_line_naming_it(args, says):
    assert says in refused("fit", "--model", "b1", "--gpu", "t4", *args)


@pytest.mark.parametrize("flag, value, fraction", [("--mfu", "45", "0.45"), ("--mod-capacity", "12.5", "0.125"),
                                                   ("--lora-dropout", "5", "0.05")])
def test_a_percent_where_a_fraction_goes_is_answered_with_the_fraction(flag, value, fraction):
    args = ("--arch", "mod") if flag == "--mod-capacity" else ()
    line = refused("fit", "--model", "b1", "--gpu", "t4", *args, flag, value)
    assert line == f"error: {flag} {value} is not a fraction: did you mean {fraction}?"


def test_a_fraction_above_any_percent_is_refused_by_its_range():
    assert refused("fit", "--model", "b1", "--gpu", "t4", "--mfu", "450") == "error: --mfu must be <= 1, got 450"
    assert fit_json("--mfu", "0.45")["fits"] is not None


def test_a_bare_adaptive_prints_its_help_and_exits_0():
    r = adaptive()
    assert r.returncode == 0, r.stderr
    assert "Usage: adaptive" in r.stdout and "fit" in r.stdout and "compare" in r.stdout
    assert "error" not in r.stderr.lower() and r.stderr.strip() == ""


def test_a_budget_winners_name_says_how_to_get_its_config(tmp_path):
    budget = adaptive("fit", "--budget-usd", "200", "--gpu", "4090", "--out", str(tmp_path / "won"), "--json")
    assert budget.returncode == 0, budget.stderr
    winner = json.loads(budget.stdout)["model"]
    assert winner.startswith("s")  # a size-ladder shape, not a preset
    line = refused("fit", "--model", winner, "--gpu", "4090")
    assert f"unknown model {winner!r}: a size-ladder shape" in line and "--out DIR" in line
    # and what the line says works: the folder --out wrote plans the same model
    again = adaptive("fit", "--model", str(tmp_path / "won"), "--gpu", "4090", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["model"] == winner
    assert json.loads(again.stdout)["arch"] == json.loads(budget.stdout)["arch"]
    # a near-miss of a preset still gets its suggestion
    assert refused("fit", "--model", "b77", "--gpu", "4090") == "error: unknown model 'b77'; did you mean b7?"
