"""`adaptive compare` as a user reads it: at 100 and 80 columns, in a pipe, its tie lines and its CSV."""

import csv
import io
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

TYPICAL = [(), ("--model", "b1"), ("--model", "b1,b7", "--arch", "dense,moe", "--gpu", "t4,4090,a100,h100-pcie"),
           ("--model", "b7", "--arch", "moe,hybrid", "--gpu", "a100-80gb,h100", "--gpus", "8", "--tokens", "300B")]


def compare(*args: str, columns: int | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if columns is not None:
        env["COLUMNS"] = str(columns)
    r = subprocess.run([sys.executable, "-m", "cli", "compare", *args], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r


def table_lines(out: str) -> list[str]:
    """The table's lines: up to the first sentence under it."""
    lines = out.splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith(("Not shown", "loss (tie)", "no: GPU", "Token")))
    return lines[:end]


@pytest.mark.parametrize("columns", [100, 80])
@pytest.mark.parametrize("args", TYPICAL, ids=lambda a: " ".join(a) or "defaults")
def test_at_a_narrow_terminal_no_cell_is_cut(args, columns):
    out = compare(*args, columns=columns).stdout
    assert "…" not in out
    table = table_lines(out)
    assert all(len(line) <= columns for line in table), max(table, key=len)
    rows = json.loads(compare(*args, "--json", columns=None).stdout)
    body = "\n".join(table)
    for r in rows:  # every plan's model and GPU are there in full, the GPU by its short name
        assert r["model"] in body and f"{r['num_gpus']}x" in body
    assert "rtx4090-2" not in body and "1x4090" in compare("--model", "b1", columns=columns).stdout


def test_at_100_columns_the_narrowest_figures_that_fit_stay_and_the_dropped_are_named():
    out = compare("--model", "b1,b7", "--arch", "dense,moe", "--gpu", "t4,4090,a100,h100-pcie", columns=100).stdout
    header = next(line for line in out.splitlines() if line.split()[:1] == ["run"])
    assert all(col in header for col in ("run", "fits", "peak", "time", "cost", "loss", "best"))
    dropped = [line for line in out.splitlines() if line.startswith("Not shown at 100 columns: ")]
    assert len(dropped) == 1 and all(col in dropped[0] for col in ("$/1B", "tok/s") if col not in header)


def test_in_a_pipe_without_columns_it_is_one_line_per_plan_at_160():
    r = compare("--model", "b1", "--arch", "dense,mod", "--gpu", "t4,4090", columns=None)
    table = table_lines(r.stdout)
    assert "…" not in r.stdout and all(len(line) <= 160 for line in table)
    header = next(line for line in table if line.split()[:1] == ["model"])
    assert all(col in header for col in ("model", "arch", "gpu", "tokens/s", "$/1B tok"))  # every column
    assert len([line for line in table if line.strip().startswith("b1 ")]) == 4  # a line per plan, none wrapped
    wider = compare("--model", "b1", "--arch", "dense", "--gpu", "t4", columns=220).stdout  # COLUMNS sets the width
    assert max(len(line) for line in table_lines(wider)) <= 220


def test_one_model_on_several_gpus_is_no_tie_and_is_best_on_each():
    args = ("--model", "b1", "--arch", "dense", "--gpu", "t4,4090,a100")
    rows = json.loads(compare(*args, "--json", columns=None).stdout)
    assert all(r["best_quality"] and not r["ties_best_quality"] and r["quality_tie"] is None for r in rows)
    assert "tie" not in compare(*args, columns=100).stdout
    # two models on three GPUs: their tie is said once, of the models, not of GPUs
    out = compare("--model", "b1", "--arch", "dense,mod", "--gpu", "t4,4090,a100", columns=200).stdout
    ties = [line for line in out.splitlines() if line.startswith("loss (tie)")]
    assert ties == ["loss (tie): b1 dense and b1 mod tie: 1.58% apart, and their bands overlap; the law cannot say "
                    "which trains the lower loss."]


def test_csv_cells_are_plain():
    out = compare("--model", "b1,b7", "--arch", "dense,moe", "--gpu", "t4,a100", "--csv", columns=None).stdout
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 8
    cells = [v for r in rows for v in r.values()]
    assert not any("[" in v or v in ("True", "False", "None") for v in cells)
    assert {r["fits"] for r in rows} == {"yes", "no"} and {r["best_quality"] for r in rows} <= {"yes", "no"}
    lo, hi = (float(x) for x in rows[0]["loss_band"].split(";"))
    assert lo < float(rows[0]["predicted_loss"]) < hi
    assert {r["why_not"] for r in rows if r["fits"] == "yes"} == {""}
    assert "yes/no" in compare("--help", columns=200).stdout
