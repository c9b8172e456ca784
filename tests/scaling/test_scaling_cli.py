"""`adaptive scale` on bad input: one line on stderr, exit code 2, nothing written; its --help imports no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import subprocess_env


def scale(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "scale", *args], capture_output=True, text=True,
                          env=subprocess_env(), timeout=timeout)


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


def test_a_tokenizer_without_a_vocab_or_data_without_its_text_field_is_one_line_and_exit_2(tmp_path):
    """Checked before any point trains: transformers builds an empty tokenizer from a folder with only a config.json,
    which would train every point on nothing."""
    empty = tmp_path / "tokenizer"
    empty.mkdir()
    (empty / "config.json").write_text('{"model_type": "gpt2"}')
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"body": "The quick brown fox."}\n{"body": "Jumps over the lazy dog."}\n')
    saved = tmp_path / "saved"
    import datasets

    datasets.Dataset.from_dict({"body": ["The quick brown fox.", "Jumps over."]}).save_to_disk(str(saved))
    for args, message in (
        (["--tokenizer", str(empty)], f"error: tokenizer '{empty.resolve()}' has no vocabulary"),
        (["--tokenizer", str(tmp_path / "none")], "error: --tokenizer"),
        (["--dataset", str(rows)], f"error: {rows}:1 has no 'text' field (fields: body); a row needs 'text'"),
        (["--dataset", str(saved)], f"error: {str(saved)!r} has no 'text' field (fields: body)"),
        (["--seeds", "0"], "error: Invalid value for '--seeds'"),
    ):
        out = tmp_path / "sweep"
        done = scale("--out", str(out), *args)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.startswith(message) and done.stderr.count("\n") == 1, (args, done.stderr)
        assert not out.exists()


def test_scale_help_and_its_checks_import_no_torch():
    code = ("import sys; from cli.main import run; rc = run(['scale', '--out', '/nonexistent/x', '--sizes', '1']); "
            "assert rc == 2; assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(),
                          timeout=120)
    assert done.stdout.strip() == "ok", done.stderr
    assert "--budgets" in scale("--help").stdout


@pytest.mark.slow
def test_a_sweep_with_its_own_tokenizer_and_saved_dataset_writes_a_joint_law_the_planner_reads(tmp_path):
    """Dense and MoE on the shipped corpus as a saved dataset (its text in a "body" column), tokenized by a
    512-token BPE saved to a folder, two seeds a point: one law.json of both archs, its multiplier, and the plot."""
    import datasets

    from adaptive.plan.quality import law_file
    from adaptive.train.data.tokenizer import DEFAULT_CORPUS, train_bpe

    tokenizer = tmp_path / "tokenizer"
    train_bpe(DEFAULT_CORPUS, 512).save_pretrained(str(tokenizer))
    saved = tmp_path / "corpus"
    docs = [d for d in DEFAULT_CORPUS.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(saved))
    out = tmp_path / "sweep"
    args = ("--out", str(out), "--arch", "dense,moe", "--budgets", "1e10,2e10", "--sizes", "2", "--seq-len", "64",
            "--bootstrap", "20", "--tokenizer", str(tokenizer), "--dataset", str(saved), "--text-field", "body",
            "--seeds", "2")
    done = scale(*args, "--jobs", "2", timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "isoFLOP sweep" in done.stdout and "wrote" in done.stdout
    assert "FLOPs, moe = " in done.stdout and "x dense compute (" in done.stdout  # the multiplier, in words
    assert "moe and dense tie" in done.stdout or "dense and moe tie" in done.stdout or " is lower than " in done.stdout
    law = law_file.load(out / "law.json")
    assert law.reference == "dense" and set(law.laws) == {"dense", "moe"} and law.multipliers["dense"] == 1.0
    assert len(law.bootstrap["moe"]) == 20 and len(law.multiplier_refits["moe"]) == 20
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["unique_tokens"] > 0  # the corpus, counted once
    seeds = {p["name"]: p for p in sweep["points"].values()}
    assert len(seeds) == 16 and all(name + "-s1" in seeds for name in seeds if not name.endswith("-s1"))
    raw = json.loads((out / "law.json").read_text())
    assert raw["archs"]["moe"]["seeds"] == 2 and raw["archs"]["moe"]["points"] == 4  # a point is its seeds' mean
    assert f"the tokenizer in {tokenizer}" in law.fitted_on and "vocab 512" in law.fitted_on
    dense = law.laws["dense"]
    assert dense.n_definition == "active" and dense.alpha == law.laws["moe"].alpha  # shared exponents
    lo, hi = dense.params_range
    assert lo < hi and dense.tokens_range[0] < dense.tokens_range[1]
    assert (out / "isoflop.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    point = json.loads(next((out / "points").glob("moe-*/point.json")).read_text())
    assert point["vocab_size"] == 512  # the model's embedding is the tokenizer's
    again = scale(*args)
    assert again.returncode == 0 and "16 of 16 points done already" in again.stdout  # nothing retrained
    other = scale(*args[:5], "1e10,4e10", *args[6:])
    assert other.returncode == 2 and "holds a sweep with other settings (budgets" in other.stderr


def _params(module: str, function: str) -> dict:
    import importlib

    import typer

    app = typer.Typer()
    app.command()(getattr(importlib.import_module(module), function))
    return {p.name: p for p in typer.main.get_command(app).params}


def test_scale_s_help_states_the_defaults_its_sweep_uses_and_nothing_it_refuses():
    """--seq-len, --micro-batch, --lr and --dataset: the default typer hands in is what the sweep trains with, and
    --help shows it; the recipes' defaults (sequence 2048, the preset's rate, C4 or a hub name) are not offered."""
    from adaptive.config.run import RunConfig
    from cli.scale import SCALE_OPTIONS, sweep_settings

    params = _params("cli.scale", "scale")
    given = {name: params[name].default for name in SCALE_OPTIONS if params[name].default is not None}
    settings = sweep_settings(RunConfig.from_options(given), ("dense",), (1e11, 2e11, 4e11), 3, 1)
    used = {"seq_len": settings.seq_len, "micro_batch": settings.micro_batch, "lr": settings.lr,
            "dataset": settings.dataset}
    assert used == {name: params[name].default for name in used} == {"seq_len": 128, "micro_batch": 4, "lr": 3e-3,
                                                                      "dataset": "builtin"}
    assert all(params[name].show_default for name in used)
    help_text = " ".join(scale("--help").stdout.split())
    for shown in ("[default: 128]", "[default: 4]", "[default: 0.003]", "[default: builtin]", "[default: dense]"):
        assert shown in help_text, shown
    for stale in ("2048;", "default 2048", "C4", "by preset", "hub dataset", "Hub name", "one law each"):
        assert stale not in help_text, stale
    assert "one law across them" in help_text  # --arch: a multiplier per arch, not a law each
    assert "--dataset (default builtin: a .txt" not in help_text  # the old summary called builtin a file
    # the shared options keep their own help elsewhere: `adaptive fit --seq-len` still defaults to 2048
    fit = _params("cli.fit", "fit")
    assert "default 2048" in fit["seq_len"].help and fit["seq_len"].default is None
