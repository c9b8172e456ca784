"""The sweep's ETA (a start-up plus a time per token, fitted on the points run so far) against hand computations, and
what `adaptive scale` prints with it: each finished point's line, the bar's ETA, a continued sweep's recorded
times, and the fit's status line and wall time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from adaptive.scaling import state
from adaptive.scaling.eta import TimeModel, duration, eta_seconds, time_model
from adaptive.scaling.grid import SweepSettings, plan_grid
from adaptive.scaling.runner import Outcome


def test_the_eta_scales_each_remaining_point_by_its_size_not_a_flat_mean():
    # sizes (tokens or FLOPs alike): 10 s of start-up and 1e-10 s per unit, exactly
    finished = [(1e11, 20.0), (2e11, 30.0), (4e11, 50.0)]
    assert time_model(finished) == TimeModel(pytest.approx(10.0), pytest.approx(1e-10))
    # two points left, of 4e11 and 8e11: (10 + 40) + (10 + 80) = 140 s; a flat mean would say 2 x 33.3 s
    assert eta_seconds(finished, [4e11, 8e11]) == pytest.approx(140.0)
    assert eta_seconds(finished, [4e11, 8e11], jobs=2) == pytest.approx(70.0)  # two at a time
    assert eta_seconds(finished, [4e11], jobs=4) == pytest.approx(50.0)  # one point left: jobs do not split it
    assert eta_seconds(finished, []) == 0.0


def test_one_size_finished_counts_all_its_time_per_unit_and_none_finished_has_no_eta():
    assert eta_seconds([], [1e11]) is None
    # 20 s at 1e11, nothing to split start-up from work: 2e-10 s per unit, so 2e11 + 4e11 take 120 s
    assert eta_seconds([(1e11, 20.0)], [2e11, 4e11]) == pytest.approx(120.0)
    # sizes within ONE_SIZE of each other are one size too: (20 + 30) s / 2e11 x 2e11
    assert eta_seconds([(1.001e11, 20.0), (0.999e11, 30.0)], [2e11]) == pytest.approx(50.0)


def test_a_noisy_fit_never_predicts_a_negative_start_up_or_time_per_flop():
    # the larger point was faster (a loaded machine): no time per unit, the mean time each
    assert time_model([(1e11, 30.0), (2e11, 20.0)]) == TimeModel(25.0, 0.0)
    assert eta_seconds([(1e11, 30.0), (2e11, 20.0)], [4e11, 4e11]) == pytest.approx(50.0)
    # the line's start-up would be -10 s: through the origin instead, (1e11 x 5 + 2e11 x 20) / (1e22 + 4e22) s/unit
    assert time_model([(1e11, 5.0), (2e11, 20.0)]) == TimeModel(0.0, pytest.approx(9e-11))
    assert eta_seconds([(1e11, 5.0), (2e11, 20.0)], [3e11]) == pytest.approx(27.0)


def test_durations_read_as_seconds_minutes_or_hours():
    assert [duration(s) for s in (0.4, 45, 200, 3599, 3900)] == ["0 s", "45 s", "3 min 20 s", "59 min 59 s",
                                                                  "1 h 05 min"]


def _point(name: str, tokens: int) -> SimpleNamespace:
    return SimpleNamespace(name=name, flops=1e11, params=1000, tokens=tokens, steps=10)


def test_each_finished_point_prints_the_eta_of_the_rest_and_the_fit_says_what_it_does(capsys):
    from cli.scale_view import SweepView

    points = [_point("a", 100_000), _point("b", 200_000), _point("c", 400_000)]  # the same FLOPs: tokens count
    view = SweepView(points)
    with view:
        view.begin(points, 0)
        view.point_start(points[0])
        view.point_end(points[0], Outcome(3.5, 20.0))  # 2e-4 s per token: 600,000 tokens left, 120 s
        assert view.eta() == "about 2 min 00 s left for 2 point(s)"
        view.point_start(points[1])
        view.point_end(points[1], Outcome(3.4, 30.0))  # 10 s + 1e-4 s per token: 50 s for the last
        assert view.eta() == "about 50 s left for 1 point(s)"
        view.point_start(points[2])
        view.point_end(points[2], Outcome(3.3, 50.0))
        assert view.eta() == ""
        view.fit_start(3, 20)
        view.refit(7)
        view.fit_end(71.2)
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal width
    assert "a: N 1,000, D 100,000 tokens, loss 3.5000 (20 s; about 2 min 00 s left for 2 point(s))" in out
    assert "b: N 1,000, D 200,000 tokens, loss 3.4000 (30 s; about 50 s left for 1 point(s))" in out
    assert "c: N 1,000, D 400,000 tokens, loss 3.3000 (50 s)" in out
    assert "fitted the law, its 20 bootstrap refits and the plot in 1 min 11 s" in out


def test_a_continued_sweep_s_eta_uses_the_times_recorded_in_sweep_json(tmp_path):
    from cli.scale_view import SweepView

    settings = SweepSettings(archs=("dense",), budgets=(1e11, 2e11, 4e11), sizes=3, dataset="builtin", seq_len=128,
                             seed=0, lr=3e-3, micro_batch=4, vocab_size=2048)
    points = plan_grid(settings)
    sweep = state.start(tmp_path, settings, points)
    # the README's sweep as measured on 2 CPU cores (2026-12-07): the 1e11 budget's widths 16, 24 and 32
    for p, seconds in zip(points[:3], (18.04, 15.53, 11.51)):
        state.finish(sweep, p.name, 5.3, seconds)
    state.save(tmp_path, sweep)
    view = SweepView(points, tmp_path, jobs=1)
    with view:
        view.begin(points, 3)
    done = [(float(p.tokens), s) for p, s in zip(points[:3], (18.04, 15.53, 11.51))]
    assert [p.tokens for p in points[:3]] == [338944, 221696, 145408]
    # least squares by hand: mean tokens 235,349.33, mean time 15.0267 s; slope 3.2702e-05 s per token, start-up 7.330 s
    model = time_model(done)
    assert model.per_unit_s == pytest.approx(3.2702e-05, rel=1e-4) and model.overhead_s == pytest.approx(7.330, abs=1e-3)
    left = sum(p.tokens for p in points[3:])
    assert view.eta() == f"about {duration(6 * model.overhead_s + model.per_unit_s * left)} left for 6 point(s)"
    # 6 x 7.330 + 3.2702e-05 x 4,235,264 tokens = 182.5 s; the 6 points took 181.4 s
    assert view.eta() == "about 3 min 02 s left for 6 point(s)"
