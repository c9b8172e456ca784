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
