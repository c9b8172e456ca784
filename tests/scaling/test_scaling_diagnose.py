"""What a sweep does not pin: a budget whose best point is its smallest or largest width (points drawn from a known
law on the sweep's own grid), a coefficient at the fit's bound or with a band over orders of magnitude; and the
picture's red rings, labels and notes."""

from __future__ import annotations

import dataclasses
import math


from adaptive.scaling import state
from adaptive.scaling.diagnose import LARGEST, SMALLEST, coefficient_warnings, diagnose, edge_optima
from adaptive.scaling.fit_law import Fit, JointFit
from adaptive.scaling.grid import SweepSettings, candidates, plan_grid, points_for

SETTINGS = SweepSettings(archs=("dense",), budgets=(1e13, 2e13, 4e13), sizes=3, dataset="builtin", seq_len=128,
                         seed=0, lr=3e-3, micro_batch=4, vocab_size=2048)
# widths swept: 32, 48, 64 at 1e13; 48, 64, 96 at 2e13; 64, 96, 128 at 4e13
INTERIOR = (1.69, 406.4, 450.0, 0.34, 0.28)  # E, A, B, alpha, beta: each budget's best is its middle width
SMALL_BEST = (1.69, 300.0, 600.0, 0.34, 0.28)  # data-hungry: each budget's best is its smallest width
LARGE_BEST = (1.8, 4000.0, 90.0, 0.34, 0.30)  # parameter-hungry: each budget's best is its largest width


def sweep_from(law: tuple[float, ...], settings: SweepSettings = SETTINGS, seeds_noise: float = 0.0) -> dict:
    """sweep.json's content with every point of `settings`' grid done, its loss the law's."""
    e, a, b, alpha, beta = law
    points = plan_grid(settings)
    sweep = {"settings": settings.as_dict(), "points": {p.name: state._entry(p) for p in points}}
    for i, p in enumerate(points):
        loss = (e + a / p.params**alpha + b / p.tokens**beta) * (1 + seeds_noise * (-1) ** i)
        state.finish(sweep, p.name, loss, 10.0)
    return sweep


def test_the_grid_sweeps_the_widths_the_cases_assume():
    widths = {c: [p.width for p in plan_grid(SETTINGS) if p.budget == c] for c in SETTINGS.budgets}
    assert widths == {1e13: [32, 48, 64], 2e13: [48, 64, 96], 4e13: [64, 96, 128]}


def test_interior_optima_give_no_warning():
    assert edge_optima(sweep_from(INTERIOR)) == []


def test_a_best_point_at_the_smallest_width_names_its_budget_and_the_widths_below():
    warnings = edge_optima(sweep_from(SMALL_BEST))
    assert [(w.budget, w.width, w.side) for w in warnings] == [(1e13, 32, SMALLEST), (2e13, 48, SMALLEST),
                                                                (4e13, 64, SMALLEST)]
    top = warnings[-1]
    assert top.add_widths == (32, 48)  # the ladder's next two below 64
    assert top.text.startswith("dense, budget 4e+13 FLOPs: best width 64 is the smallest swept, so the optimum may "
                               "lie below it; add widths below 64 (e.g. 32, 48): rerun into a new --out with --sizes ")
    # the --sizes it names does sweep one of those widths at that budget, and one fewer does not
    sizes = int(top.text.rsplit("--sizes ", 1)[1])
    wider = points_for("dense", 4e13, dataclasses.replace(SETTINGS, sizes=sizes))
    assert {32, 48} & {p.width for p in wider}
    assert not {32, 48} & {p.width for p in points_for("dense", 4e13, dataclasses.replace(SETTINGS, sizes=sizes - 1))}


def test_a_best_point_at_the_largest_width_names_the_widths_above():
    warnings = edge_optima(sweep_from(LARGE_BEST))
    assert [(w.budget, w.width, w.side) for w in warnings] == [(1e13, 64, LARGEST), (2e13, 96, LARGEST),
                                                                (4e13, 128, LARGEST)]
    assert warnings[0].add_widths == (96, 128)
    assert "best width 64 is the largest swept, so the optimum may lie above it; add widths above 64 (e.g. 96, " \
           "128)" in warnings[0].text


def test_the_ladder_s_smallest_width_at_the_edge_says_to_raise_the_budget():
    """The default sweep (1e11-4e11 FLOPs) trains widths 16, 24, 32: 16 is the ladder's smallest."""
    default = dataclasses.replace(SETTINGS, budgets=(1e11, 2e11, 4e11))
    warnings = edge_optima(sweep_from(SMALL_BEST, default))
    assert warnings and all(w.width == 16 and w.add_widths == () for w in warnings)
    assert warnings[0].text.endswith("the ladder has no width below 16: raise this budget instead")


def test_the_edge_is_judged_on_done_points_only():
    sweep = sweep_from(INTERIOR)
    at = {p["width"]: p for p in sweep["points"].values() if p["budget"] == 1e13}
    state.finish(sweep, at[48]["name"], float("nan"), 10.0)  # the middle width of 1e13 diverged
    best = min((32, 64), key=lambda w: at[w]["eval_loss"])  # now at an edge of what was measured
    assert [(w.budget, w.width, w.side) for w in edge_optima(sweep)] == [
        (1e13, best, SMALLEST if best == 32 else LARGEST)]


def test_the_edge_is_judged_on_the_mean_of_a_point_s_seeds():
    sweep = sweep_from(INTERIOR, dataclasses.replace(SETTINGS, seeds=2))
    by = {(p["budget"], p["width"], p["replica"]): p for p in sweep["points"].values()}
    middle = by[(1e13, 48, 0)]["eval_loss"]
    # one lucky seed at width 32 beats the middle width, its mean does not: no edge
    state.finish(sweep, by[(1e13, 32, 0)]["name"], middle - 0.01, 10.0)
    state.finish(sweep, by[(1e13, 32, 1)]["name"], middle + 0.05, 10.0)
    assert edge_optima(sweep) == []
    state.finish(sweep, by[(1e13, 32, 1)]["name"], middle - 0.01, 10.0)  # both seeds: it is the best
    assert [(w.budget, w.width) for w in edge_optima(sweep)] == [(1e13, 32)]


def _joint(e: float = 1.8, a: float = 400.0, b: float = 900.0, alpha: float = 0.34, beta: float = 0.3) -> JointFit:
    return JointFit(e, a, b, alpha, beta, {"dense": 1.0}, "dense", 0.001, 9)


def test_a_coefficient_at_its_bound_or_with_a_band_over_orders_of_magnitude_warns():
    budgets = (1e13, 2e13, 4e13)
    sound = _joint()
    refits = [_joint(1.8 * f, 400.0 * f, 900.0 * f) for f in (0.9, 0.95, 1.0, 1.05, 1.1)]
    assert coefficient_warnings(sound, refits, budgets, 3) == []
    at_bound = _joint(e=math.exp(-10.0))  # fit_law.BOUNDS: log E >= -10, the user's E = 4.5e-05
    wide = [_joint(1.8, 400.0 * 10.0**k, 900.0) for k in range(-8, 9)]  # A's refits over 16 orders of magnitude
    lines = [w.text for w in coefficient_warnings(at_bound, wide, budgets, 3)]
    assert len(lines) == 2, lines
    assert lines[0].startswith("E = 4.54e-05: at its lower bound (4.5e-05), where the fit stopped. The sweep does "
                               "not pin it")
    assert lines[0].endswith("add budgets above 4e+13 (e.g. 8e+13, 1.6e+14)")
    # the 5% and 95% quantiles of 400 x 10^-8..10^8 (17 refits, interpolated): 3.28e-05 and 1.12e+10, 14.5 orders
    assert lines[1].startswith("A = 400: its 5-95% band spans 15 orders of magnitude (3.3e-05 to 1.1e+10)")
    assert lines[1].endswith("add sizes (--sizes 5 into a new --out)")
    exponent = coefficient_warnings(_joint(alpha=4.0), refits, budgets, 3)
    assert [w.text.split(":")[0] for w in exponent] == ["alpha = 4"]
    assert "at its upper bound (4)" in exponent[0].text


def test_diagnose_reads_the_sweep_and_the_law():
    law = type("Law", (), {"fit": _joint(e=math.exp(-10.0)), "bootstrap": [], "budgets": SETTINGS.budgets})()
    found = diagnose(sweep_from(SMALL_BEST), law)
    assert [w.width for w in found] == [32, 48, 64, None]  # three edges, then E
    assert [w.text[:3] for w in diagnose(sweep_from(INTERIOR), law)] == ["E ="]


def test_the_picture_rings_the_edge_points_and_writes_the_warnings(tmp_path):
    import matplotlib.pyplot as plt

    from adaptive.scaling.plot import EDGE_COLOR, draw, figure

    sweep = sweep_from(SMALL_BEST)
    points = state.results(sweep)
    fits = {"dense": Fit(*SMALL_BEST, rmse_log=0.0, points=9)}
    cands = {"dense": candidates("dense", 2048, 128)}
    warnings = edge_optima(sweep)
    fig = figure(points, fits, cands, (), warnings)
    top = fig.axes[0]
    labels = [t.get_text() for t in top.texts]
    assert labels == ["best at the edge: add widths below 32", "best at the edge: add widths below 48",
                      "best at the edge: add widths below 64"]
    rings = [line for line in top.lines if isinstance(line.get_markeredgecolor(), str)
             and line.get_markeredgecolor() == EDGE_COLOR]
    assert sorted(float(line.get_xdata()[0]) for line in rings) == sorted(
        float(p["params"]) for p in points if (p["budget"], p["width"]) in {(w.budget, w.width) for w in warnings})
    assert fig._suptitle is not None and fig._suptitle.get_text().startswith("warning: the sweep does not pin")
    notes = " ".join(t.get_text() for t in fig.texts)
    assert "best width 64 is the smallest swept" in " ".join(notes.split())
    plt.close(fig)
    clean = figure(state.results(sweep_from(INTERIOR)), fits, cands, (), [])
    assert not clean.axes[0].texts and clean._suptitle is None and not clean.texts
    plt.close(clean)
    assert draw(tmp_path / "isoflop.png", points, fits, cands, (), warnings).read_bytes()[:4] == b"\x89PNG"


def test_the_results_mark_the_edge_points_and_print_every_warning(capsys, tmp_path):
    from adaptive.scaling.sweep import Scaled, SweepLaw, observations
    from cli.scale_view import show_result

    sweep = sweep_from(SMALL_BEST)
    fit = _joint(e=math.exp(-10.0))
    law = SweepLaw(fit, [fit] * 3, observations(sweep), SETTINGS.budgets)
    warnings = tuple(w.text for w in diagnose(sweep, law))
    show_result(Scaled(sweep, law, [], tmp_path / "law.json", tmp_path / "isoflop.png", 71.0, warnings))
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("* (edge)") == 3  # each budget's best row
    assert "(edge): the smallest or largest width swept, see the warnings" in out
    assert "warning: dense, budget 4e+13 FLOPs: best width 64 is the smallest swept" in out
    assert "warning: E = 4.54e-05: at its lower bound (4.5e-05)" in out
