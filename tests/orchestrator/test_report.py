"""`adaptive report RUN_DIR` on a finished debug MoE run (the faulty run of test_faults.py: OOMs, NaNs, a
rollback): a valid PNG of the stated size whose panels hold the run's own numbers."""

from __future__ import annotations

import json

import pytest

from adaptive.orchestrator.report import DPI, build_figure, load_run
from cli.main import run as cli

PANELS = {"Loss", "Throughput", "Memory", "MaxVio and dropped fraction", "Orchestrator decisions"}


@pytest.fixture(scope="module")
def faulty(fault_runs):
    return fault_runs["faulty"]


def by_title(fig, title):
    return next(ax for ax in fig.axes if ax.get_title() == title)


def last_per_step(out, key):
    rows = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "train":
            rows[r["step"]] = r[key]
    return [rows[s] for s in sorted(rows)]


@pytest.mark.slow  # reads a real faulty run
def test_report_writes_a_valid_png_and_a_summary(faulty, tmp_path, capsys):
    from matplotlib.image import imread

    png = tmp_path / "report.png"
    assert cli(["report", str(faulty), "--out", str(png)]) == 0
    image = imread(png)
    width, height = build_figure(load_run(faulty)).get_size_inches()
    assert image.shape == (int(height * DPI), int(width * DPI), 4)
    assert 0.05 < image[..., :3].std(), "not a blank canvas"
    shown = capsys.readouterr().out
    for text in ("debug moe", "halve_micro_batch x1, enable_checkpointing x1", "rollback x1", f"Wrote {png}"):
        assert text in shown, shown


@pytest.mark.slow  # reads a real faulty run
def test_the_panels_hold_the_runs_numbers(faulty):
    run = load_run(faulty)
    fig = build_figure(run)
    titles = {ax.get_title() for ax in fig.axes}
    assert PANELS <= titles and "MoD skip rate" not in titles  # a MoE run: no MoD panel, no placeholder
    assert {f"Expert load, MoE layer {i}" for i in range(5)} <= titles  # debug MoE: 5 MoE layers
    steps = list(range(1, 17))
    loss_ax = by_title(fig, "Loss")
    loss = next(line for line in loss_ax.get_lines() if line.get_label() == "train loss")
    assert list(loss.get_xdata()) == steps
    assert list(loss.get_ydata()) == pytest.approx(last_per_step(faulty, "loss"))  # the replayed steps' values
    # heatmap of MoE layer 2: each column is that step's share of routes per expert
    image = by_title(fig, "Expert load, MoE layer 2").get_images()[0].get_array()
    counts = last_per_step(faulty, "expert_counts")
    assert image.shape == (8, 16)
    for column, step_counts in enumerate(counts):
        row = step_counts[2]
        assert [image[e, column] for e in range(8)] == pytest.approx([c / sum(row) for c in row])
    vio_ax = by_title(fig, "MaxVio and dropped fraction")
    assert list(vio_ax.get_lines()[0].get_ydata()) == pytest.approx(last_per_step(faulty, "max_vio_max"))
    dropped = [ax for ax in fig.axes if ax.get_ylabel() == "dropped fraction"][0].get_lines()[0].get_ydata()
    assert list(dropped) == pytest.approx([sum(d) / len(d) for d in last_per_step(faulty, "dropped_fraction")])


@pytest.mark.slow  # reads a real faulty run
def test_the_decisions_are_marked_on_the_timeline(faulty):
    run = load_run(faulty)
    fig = build_figure(run)
    timeline = by_title(fig, "Orchestrator decisions")
    marks = {line.get_label(): list(line.get_xdata()) for line in timeline.get_lines()}
    assert marks["oom"] == [5, 7]
    assert marks["guard"] == [11, 13, 14, 14, 13]  # skips, the rollback, then the LR restored in the replay
    assert marks["ep"] == [16]
    assert len(marks["balance"]) == 20  # every logged step, the replayed ones included
    labels = {t.get_text() for t in timeline.texts}
    assert {"halve_micro_batch", "enable_checkpointing", "rollback", "restore_lr"} <= labels
    loss_ax = by_title(fig, "Loss")
    lines = sorted(line.get_xdata()[0] for line in loss_ax.get_lines() if line.get_linestyle() == "--")
    assert lines == [5, 7, 11, 13, 13, 14, 14]


def test_a_mod_run_without_events_draws_its_skip_rates(tmp_path):
    rows = [{"kind": "start", "step": 0, "preset": "debug", "arch": "mod"}]
    rates = [[0.5, 0.52], [0.49, 0.51], [0.5, 0.5]]
    for step, r in enumerate(rates, start=1):
        rows.append({"kind": "train", "step": step, "loss": 5.0 - step, "ppl": 2.0 ** (5 - step), "expert_counts": None,
                     "max_vio_max": None, "dropped_fraction": None, "mod_skip_rate": r})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = build_figure(load_run(tmp_path))
    mod = by_title(fig, "MoD skip rate")
    assert [list(line.get_ydata()) for line in mod.get_lines()] == [[0.5, 0.49, 0.5], [0.52, 0.51, 0.5]]
    # only what the run has: no expert panels, no decisions timeline, no memory (these records carry none)
    assert {ax.get_title() for ax in fig.axes if ax.get_title()} == {"Loss", "Throughput", "MoD skip rate"}
    assert not [t.get_text() for ax in fig.axes for t in ax.texts]


def test_a_folder_without_a_run_is_one_line_and_exit_2(tmp_path, capsys):
    assert cli(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "has no metrics.jsonl" in err and err.count("\n") == 1
    assert cli(["report", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_report_command_imports_no_torch(tmp_path):
    import subprocess
    import sys

    from tests.train._launch import launch_env

    code = ("import sys, cli.main, adaptive.orchestrator.report; "
            "print([m for m in ('torch', 'deepspeed', 'transformers', 'matplotlib') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], env=launch_env(tmp_path), capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "[]", done.stderr


def test_a_run_without_the_orchestrator_says_it_was_off_and_why(tmp_path, capsys):
    records = [{"kind": "start", "step": 0, "preset": "debug", "arch": "dense",
                "orchestrator": {"requested": "auto", "enabled": False, "reason": "a short run"}}]
    records += [{"kind": "train", "step": s, "loss": 7.0 - 0.1 * s, "ppl": 1000.0 / s, "tokens_seen": 256 * s}
                for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cli(["report", str(tmp_path)]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "off (--orchestrator auto; a short run)" in shown, shown
    assert (tmp_path / "report.png").stat().st_size > 0


def test_a_gpu_run_draws_its_gpu_memory_and_an_mfu_scale(tmp_path):
    """MFU is tokens/s times a constant while the seq_len in force stays: a second scale of the throughput axis."""
    rows = [{"kind": "start", "step": 0, "preset": "b1", "arch": "dense", "tokens_per_step": 4096}]
    rows += [{"kind": "train", "step": s, "interval_steps": 1, "loss": 7.0 - 0.1 * s, "tokens_per_s": tps,
              "train_seconds": 4096 / tps, "mfu": tps * 1e-5, "peak_rss_bytes": 5 * 2**30,
              "memory": {"allocated_bytes": 2**30, "peak_allocated_bytes": s * 2**30, "reserved_bytes": 9 * 2**30}}
             for s, tps in ((1, 30000.0), (2, 40000.0), (3, 41000.0))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = build_figure(load_run(tmp_path))
    memory = {line.get_label(): list(line.get_ydata()) for line in by_title(fig, "Memory").get_lines()}
    assert memory == {"GPU peak allocated (interval)": [1.0, 2.0, 3.0], "host peak RSS (so far)": [5.0, 5.0, 5.0]}
    throughput = by_title(fig, "Throughput")
    [mfu_axis] = [child for child in throughput.child_axes if child.get_ylabel() == "MFU %"]
    fig.canvas.draw()
    low, high = throughput.get_ylim()
    assert mfu_axis.get_ylim() == pytest.approx((100 * low * 1e-5, 100 * high * 1e-5))
