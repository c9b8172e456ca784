"""One run configuration: fit, launch and the recipes show each shared option with the same help, every
flag a user typed before still parses, and launch hands a recipe exactly the options it was given."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from adaptive.config import RunConfig
from adaptive.config.commandline import parse
from adaptive.config.run import FIT, LAUNCH, TRAIN, options_for, to_argv
from tests.conftest import REPO_ROOT, subprocess_env

RECIPE = str(REPO_ROOT / "recipes" / "debug_moe.py")


def _help(*command: str) -> dict[str, str]:
    """flag -> its help text, read from the rendered --help (one row per option at this width)."""
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120,
                          env=subprocess_env(COLUMNS="400", TERM="dumb"), cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    rows = {}
    for line in done.stdout.splitlines():
        cells = [c for c in re.split(r"\s{2,}", line.strip("│ ").strip()) if c]
        if cells and cells[0].startswith("--"):
            flag = cells[0].split(",")[0].split()[0]
            rows[flag] = cells[-1]
    return rows


@pytest.fixture(scope="module")
def helps():
    adaptive = [sys.executable, "-m", "cli"]
    return {"fit": _help(*adaptive, "fit"), "launch": _help(*adaptive, "launch"),
            "recipe": _help(sys.executable, RECIPE)}


def test_fit_launch_and_a_recipe_show_every_shared_option_with_the_same_help(helps):
    shared = {f.name for _, _, f in options_for(FIT)} & {f.name for _, _, f in options_for(LAUNCH)} \
        & {f.name for _, _, f in options_for(TRAIN)}
    assert {"--model", "--arch", "--gpu", "--gpus", "--nodes", "--seq-len", "--min-seq-len", "--tokens", "--zero",
            "--offload", "--micro-batch", "--grad-accum", "--ep-size", "--checkpointing"} <= shared
    for flag in sorted(shared):
        texts = {name: rows.get(flag) for name, rows in helps.items()}
        assert None not in texts.values(), f"{flag} missing from {[n for n, t in texts.items() if t is None]}"
        assert len(set(texts.values())) == 1, f"{flag}: {texts}"


def test_the_help_shown_is_the_one_definition(helps):
    for _, _, flag in options_for(TRAIN):
        shown = helps["recipe"][flag.name]
        assert shown.startswith(flag.help.split(";")[0][:40]), (flag.name, shown)


def test_launch_takes_every_option_a_recipe_takes(helps):
    assert set(helps["recipe"]) - {"--dry-run", "--help"} <= set(helps["launch"])


@pytest.mark.parametrize("argv, field, value", [
    (["--no-checkpointing"], "gradient_checkpointing", False),
    (["--checkpointing"], "gradient_checkpointing", True),
    (["--output-dir", "runs/x"], "output_dir", "runs/x"),
    (["--run-dir", "runs/x"], "output_dir", "runs/x"),
    (["--resume"], "resume", "auto"),
    (["--resume", "--lr", "1e-4"], "resume", "auto"),
    (["--resume", "runs/x/checkpoints/step_00000010"], "resume", "runs/x/checkpoints/step_00000010"),
    (["--lr", "3e-4"], "lr", 3e-4),
    (["--zero", "2"], "zero", 2),
    (["--offload", "optimizer"], "offload", "optimizer"),
    (["--micro-batch", "4", "--grad-accum", "8"], "grad_accum", 8),
    (["--no-progress"], "progress", False),
    (["--orchestrator", "off"], "orchestrator", "off"),
])
def test_the_flags_users_type_keep_their_names_and_meaning(argv, field, value):
    assert parse(TRAIN, argv).flat()[field] == value


@pytest.mark.parametrize("argv, message", [
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--lr", "-1"], "--lr must be positive"),
    (["--micro-batch", "0"], "--micro-batch must be positive"),
    (["--zero", "4"], "--zero must be <= 3"),
    (["--warmup-steps", "-1"], "--warmup-steps must be >= 0"),
])
def test_bad_values_are_refused_by_the_one_definition(argv, message):
    from adaptive.errors import AdaptiveError

    with pytest.raises(AdaptiveError, match=re.escape(message)):
        parse(TRAIN, argv)


def test_to_argv_gives_back_the_same_configuration():
    config = parse(TRAIN, ["--model", "debug", "--lr", "0.001", "--no-checkpointing", "--resume", "--zero", "1",
                           "--orchestrator-config", '{"guard": {"bad_steps": 2}}', "--no-progress"])
    assert parse(TRAIN, to_argv(config, TRAIN)) == config
    assert to_argv(RunConfig(), TRAIN) == []  # defaults are not written out


@pytest.mark.parametrize("command", ["fit", "launch", "measure", "compare", "export", "report", "models", "gpus"])
def test_help_at_80_columns_shows_every_option_name_whole(command, monkeypatch, capsys):
    import typer

    from cli.main import app, run

    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("TERMINAL_WIDTH", raising=False)
    assert run([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 80
    click_command = typer.main.get_command(app).commands[command]
    names = [n for p in click_command.params for n in (*p.opts, *p.secondary_opts) if n.startswith("--")]
    whole = [name for name in names if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", out)]
    assert names and whole == names, set(names) - set(whole)
