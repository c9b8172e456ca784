"""A real debug dense run, as a user launches it: the plan line reads its knobs as a phrase, the run ends with a
summary block whose numbers are the metrics.jsonl's own (computed again here from the train records), the printed
generate command works, and `adaptive report` draws exactly the panels a dense run has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from adaptive.orchestrator.report import build_figure, load_run
from adaptive.train.reporting.summary import duration, generate_command, knobs_line
from cli.main import run as cli
from tests.train._launch import REPO, accelerate_launch, launch_env, records, tail

STEPS, LOG_EVERY, EVAL_EVERY = 12, 4, 8


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    out = tmp_path_factory.mktemp("summary") / "run"
    began = time.time()
    done = accelerate_launch(REPO / "recipes" / "debug_dense.py",
                             ["--max-steps", str(STEPS), "--seq-len", "64", "--output-dir", str(out), "--log-every",
                              str(LOG_EVERY), "--eval-every", str(EVAL_EVERY), "--no-progress"],
                             home=home, ADAPTIVE_CACHE=str(home / "cache"))
    assert done.returncode == 0, tail(done)
    return out, done, time.time() - began, home


def expected_tokens_per_s(out):
    """The train records' tokens over their step seconds, less the first step (its warm-up, in the end record)."""
    start, end = records(out, "start")[0], records(out, "end")[-1]
    train = records(out, "train")
    tokens = sum(r["interval_steps"] for r in train) * start["tokens_per_step"]
    seconds = sum(r["train_seconds"] for r in train)
    assert sum(r["tokens_per_s"] * r["train_seconds"] for r in train) == pytest.approx(tokens)
    return (tokens - start["tokens_per_step"]) / (seconds - end["warmup_seconds"])


@pytest.mark.slow  # a real recipe run
def test_the_run_ends_with_a_summary_of_its_own_numbers(dense_run):
    out, done, elapsed, _ = dense_run
    log = done.stdout + done.stderr
    start, end = records(out, "start")[0], records(out, "end")[-1]
    train, evals = records(out, "train"), records(out, "eval")
    assert f"(fp32), {knobs_line(start['knobs'])}, DeepSpeed config" in log and "knobs {" not in log
    assert knobs_line(start["knobs"]).startswith("mb ")
    block = log[log.index("run finished"):]
    assert [r["step"] for r in evals] == [8, 12] and end["eval_loss"] == evals[-1]["eval_loss"]
    assert end["loss"] == train[-1]["loss"] and end["loss_steps"] == LOG_EVERY
    assert f"final loss  train {train[-1]['loss']:.4f} (mean of the last {LOG_EVERY} steps), " \
           f"eval {evals[-1]['eval_loss']:.4f} (ppl {evals[-1]['eval_ppl']:.2f})" in block, block
    assert f"steps       {STEPS} ({STEPS * start['tokens_per_step']:,} tokens)" in block
    assert end["tokens_per_s"] == pytest.approx(expected_tokens_per_s(out), rel=1e-9)
    assert f"speed       {expected_tokens_per_s(out):,.0f} tokens/s" in block and "MFU n/a" in block
    # the wall time covers the steps and the process's setup, and no more than the launch the test timed
    assert sum(r["train_seconds"] for r in train) == pytest.approx(end["train_seconds"])
    assert end["train_seconds"] < end["wall_seconds"] < elapsed
    assert f"wall time   {duration(end['wall_seconds'])}, of which training steps {duration(end['train_seconds'])}" \
           in block
    assert end["peak_memory_kind"] == "cpu_rss" and end["peak_memory_bytes"] >= max(r["peak_rss_bytes"] for r in train)
    assert 50 * 2**20 < end["peak_memory_bytes"] < 64 * 2**30
    assert f"memory      {end['peak_memory_bytes'] / 2**30:.2f} GiB process peak RSS" in block
    for line in (f"run folder  {out}", f"checkpoint  {out}/checkpoints/step_{STEPS:08d}", f"HF model    {out}/hf",
                 f"adaptive report {out}", generate_command(out / "hf")):
        assert line in block, block
    assert "adaptive export" not in block and not end["export_remote_code"]  # a Llama export: nothing to convert
    assert end["launches"] == 1 and end["first_step"] == 0 and end["adapter"] is None


@pytest.mark.slow  # a real recipe run, and the export loaded by transformers' pipeline
def test_the_printed_generate_command_generates(dense_run, tmp_path):
    out, _, _, home = dense_run
    env = {**launch_env(home), "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    done = subprocess.run(["bash", "-c", generate_command(out / "hf")], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    text = done.stdout.strip()  # the prompt and 20 new tokens (newlines among them, from a tiny model)
    assert text.startswith("The devil is") and len(text) > len("The devil is") + 5, done.stdout


@pytest.mark.slow  # reads a real run
def test_a_dense_runs_report_has_its_panels_and_no_placeholders(dense_run):
    out = dense_run[0]
    fig = build_figure(load_run(out))
    titled = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert set(titled) == {"Loss", "Throughput", "Memory"}
    assert not [t.get_text() for ax in fig.axes for t in ax.texts]  # no "no MoE layers" placeholder
    train, evals = records(out, "train"), records(out, "eval")
    lines = {line.get_label(): line for line in titled["Loss"].get_lines()}
    assert list(lines["train loss"].get_xdata()) == [r["step"] for r in train]
    assert list(lines["train loss"].get_ydata()) == pytest.approx([r["loss"] for r in train])
    eval_points = lines["eval loss"]  # on the loss axis itself, as points
    assert eval_points.get_linestyle() == "None" and eval_points.get_marker() == "o"
    assert list(eval_points.get_xdata()) == [8, 12]
    assert list(eval_points.get_ydata()) == pytest.approx([r["eval_loss"] for r in evals])
    assert len(titled["Loss"].get_lines()) == 2  # no perplexity curve: a second scale of the same axis
    speeds, mean = titled["Throughput"].get_lines()
    assert list(speeds.get_ydata()) == pytest.approx([r["tokens_per_s"] for r in train])
    assert list(mean.get_ydata()) == pytest.approx([expected_tokens_per_s(out)] * 2)
    memory = {line.get_label(): line for line in titled["Memory"].get_lines()}
    assert set(memory) == {"host peak RSS (so far)"}  # a CPU run: no GPU line
    assert list(memory["host peak RSS (so far)"].get_ydata()) == pytest.approx([r["peak_rss_bytes"] / 2**30
                                                                                for r in train])


@pytest.mark.slow  # reads a real run
def test_the_report_summary_shows_wall_time_and_tokens_per_s(dense_run, tmp_path, capsys):
    out = dense_run[0]
    end = records(out, "end")[-1]
    assert cli(["report", str(out), "--out", str(tmp_path / "r.png")]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert f"wall time {duration(end['wall_seconds'])}" in shown, shown
    assert f"tokens/s {expected_tokens_per_s(out):,.0f} (this launch, first step left out)" in shown, shown
    assert f"peak memory {end['peak_memory_bytes'] / 2**30:.2f} GiB process peak RSS" in shown


def test_an_unfinished_runs_report_takes_its_speed_from_the_logged_intervals(tmp_path, capsys):
    rows = [{"kind": "start", "step": 0, "preset": "debug", "arch": "dense", "tokens_per_step": 512}]
    rows += [{"kind": "train", "step": 4 * i, "interval_steps": 4, "loss": 7.0 - i, "ppl": 100.0, "tokens_per_s": tps,
              "train_seconds": 2048 / tps, "peak_rss_bytes": (i + 1) * 2**30} for i, tps in enumerate((1000.0, 3000.0),
                                                                                                     start=1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli(["report", str(tmp_path)]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "tokens/s 1,500 (logged intervals)" in shown, shown  # 4096 tokens over 2.048 + 0.683 s
    assert "not finished: no wall time" in shown and "peak memory 3.00 GiB process peak RSS" in shown
    titles = {ax.get_title() for ax in build_figure(load_run(tmp_path)).axes}
    assert titles == {"Loss", "Throughput", "Memory"}
