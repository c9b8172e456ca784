"""A 2 x 2 isoFLOP sweep of tiny models through the recipes' path: each point its own run folder with metrics
and a checkpoint; Ctrl-C after a point and a rerun finish the sweep without retraining what was done.

The sweep takes ~30 s on 2 idle cores (5 recipe processes of ~8 s start-up each), so its tests are marked slow;
the quick subset keeps the fit's tests (test_scaling_fit.py) and the resume and divergence rules below."""

from __future__ import annotations

import json

import pytest

from adaptive.scaling import state
from adaptive.scaling.grid import SweepSettings, plan_grid
from adaptive.scaling.runner import RUN_DIR, _end, metrics, recipe_flags
from adaptive.scaling.sweep import POINTS_DIR, Events, run_sweep

SETTINGS = SweepSettings(archs=("dense",), budgets=(8e9, 1.6e10), sizes=2, dataset="builtin", seq_len=64, seed=0,
                         lr=3e-3, micro_batch=4, vocab_size=2048)


class StopAfterFirst(Events):
    def point_end(self, point, outcome) -> None:
        raise KeyboardInterrupt  # what Ctrl-C between two points does


def runs_started(out, name: str) -> int:
    return (out / POINTS_DIR / name / "train.log").read_text().count("$ ")


@pytest.fixture(scope="module")
def interrupted_then_finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    with pytest.raises(KeyboardInterrupt):
        run_sweep(SETTINGS, out, StopAfterFirst())
    after_interrupt = json.loads((out / state.SWEEP_FILE).read_text())
    finished = run_sweep(SETTINGS, out, jobs=2)
    return out, after_interrupt, finished


@pytest.mark.slow
def test_an_interrupted_sweep_keeps_the_finished_point(interrupted_then_finished):
    _, after_interrupt, _ = interrupted_then_finished
    statuses = [p["status"] for p in after_interrupt["points"].values()]
    assert statuses == ["done", "pending", "pending", "pending"]


@pytest.mark.slow
def test_the_rerun_finishes_the_sweep_without_retraining_the_finished_point(interrupted_then_finished):
    out, after_interrupt, finished = interrupted_then_finished
    first = next(iter(after_interrupt["points"]))
    assert all(p["status"] == "done" for p in finished["points"].values())
    assert finished["points"][first]["eval_loss"] == after_interrupt["points"][first]["eval_loss"]
    for name in finished["points"]:
        assert runs_started(out, name) == 1, name
    assert json.loads((out / state.SWEEP_FILE).read_text()) == json.loads(json.dumps(finished))


@pytest.mark.slow
def test_each_point_is_a_recipe_run_with_its_metrics_checkpoint_and_export(interrupted_then_finished):
    out, _, finished = interrupted_then_finished
    for name, p in finished["points"].items():
        run = out / POINTS_DIR / name / RUN_DIR
        records = metrics(run)
        start = next(r for r in records if r["kind"] == "start")
        assert start["params_active"] == p["params"]  # the run trained the shape the law counts
        assert start["max_steps"] == p["steps"]
        end = records[-1]
        assert end["kind"] == "end" and end["eval_loss"] == p["eval_loss"]
        assert (run / "checkpoints").is_dir() and (run / "hf" / "config.json").is_file()
    by_budget = {}
    for p in finished["points"].values():
        by_budget.setdefault(p["width"], []).append((p["budget"], p["eval_loss"]))
    for runs in by_budget.values():  # the same model trained on twice the tokens ends lower
        (_, small), (_, big) = sorted(runs)
        assert big < small


def test_a_rerun_resumes_a_point_with_a_checkpoint_and_restarts_one_without(tmp_path):
    point = plan_grid(SETTINGS)[0]
    run = tmp_path / RUN_DIR
    fresh = recipe_flags(point, SETTINGS, run)
    assert "--resume" not in fresh and "--overwrite" not in fresh
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "start", "step": 0}\n')
    assert recipe_flags(point, SETTINGS, run)[-1] == "--overwrite"
    (run / "checkpoints" / "step_00000050").mkdir(parents=True)
    assert recipe_flags(point, SETTINGS, run)[-1] == "--resume"


def test_a_run_that_ends_with_a_nan_loss_or_skips_its_steps_diverged(tmp_path):
    point = plan_grid(SETTINGS)[0]
    (tmp_path / "metrics.jsonl").write_text(
        '{"kind": "start", "step": 0}\n'
        f'{{"kind": "end", "step": {point.steps}, "eval_loss": NaN, "skipped_steps": 0}}\n')
    assert _end(tmp_path, point).diverged == "final eval loss is nan"
    (tmp_path / "metrics.jsonl").write_text(
        f'{{"kind": "end", "step": {point.steps}, "eval_loss": 5.0, "skipped_steps": {point.steps // 2}}}\n')
    assert "steps skipped for non-finite losses" in _end(tmp_path, point).diverged
    sweep = {"points": {point.name: {"status": "pending"}}}
    state.finish(sweep, point.name, float("nan"), 1.0, None)
    assert sweep["points"][point.name]["status"] == "diverged"
    assert sweep["points"][point.name]["reason"] == "final eval loss is nan"
