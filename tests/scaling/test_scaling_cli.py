"""`adaptive scale` on bad input: one line on stderr, exit code 2, nothing written; its --help imports no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import subprocess_env


def scale(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "scale", *args], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)


@pytest.mark.parametrize("args, message", [
    (["--budgets", "-1e11,4e11"], "error: --budgets must be positive FLOP counts, got -1e+11"),
    (["--budgets", "1e11,4e11,abc"], "error: --budgets takes comma-separated FLOP counts"),
    (["--sizes", "1"], "error: --sizes must be at least 2"),
    (["--arch", "dense,hybird"], "error: unknown --arch 'hybird'; did you mean hybrid?"),
    (["--budgets", "1e11,4e11", "--sizes", "2"], "error: --budgets x --sizes gives 4 points per architecture"),
    (["--dataset", "no/such/corpus.txt"], "error: --dataset 'no/such/corpus.txt': no such file or folder"),
    (["--lr", "0"], "error: --lr must be positive"),
])
def test_bad_input_is_one_line_and_exit_2_and_writes_nothing(tmp_path, args, message):
    out = tmp_path / "sweep"
    done = scale("--out", str(out), *args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr
    assert not out.exists()


def test_scale_help_and_its_checks_import_no_torch():
    code = ("import sys; from cli.main import run; rc = run(['scale', '--out', '/nonexistent/x', '--sizes', '1']); "
            "assert rc == 2; assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                          timeout=120)
    assert done.stdout.strip() == "ok", done.stderr
    assert "--budgets" in scale("--help").stdout


@pytest.mark.slow
def test_a_sweep_on_the_shipped_corpus_writes_a_law_the_planner_reads_and_a_plot(tmp_path):
    from adaptive.plan.quality import law_file

    out = tmp_path / "sweep"
    done = scale("--out", str(out), "--budgets", "2e10,4e10", "--sizes", "3", "--seq-len", "64", "--jobs", "2",
                 "--bootstrap", "20")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "isoFLOP sweep" in done.stdout and "wrote" in done.stdout
    law = law_file.load(out / "law.json")
    dense = law.laws["dense"]
    assert dense.n_definition == "active" and len(law.bootstrap["dense"]) == 20
    lo, hi = dense.params_range
    assert lo < hi and dense.tokens_range[0] < dense.tokens_range[1]
    assert (out / "isoflop.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = scale("--out", str(out), "--budgets", "2e10,4e10", "--sizes", "3", "--seq-len", "64", "--bootstrap", "20")
    assert again.returncode == 0 and "6 of 6 points done already" in again.stdout  # nothing retrained
    other = scale("--out", str(out), "--budgets", "2e10,8e10", "--sizes", "3", "--seq-len", "64")
    assert other.returncode == 2 and "holds a sweep with other settings (budgets" in other.stderr
