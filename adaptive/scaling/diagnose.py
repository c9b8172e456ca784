"""Where a sweep does not pin its law: a budget whose best point sits at the edge of the widths swept, a fitted
coefficient at the bound the fit allows it, a bootstrap band that spans orders of magnitude.

An isoFLOP curve locates a budget's optimum only when the sweep has points on both sides of it. When the lowest
loss at a budget is its smallest (largest) width, the true optimum may lie below (above) the widths swept, and the
law's N_opt(C) there is an extrapolation. A coefficient at its bound (fit_law.BOUNDS: E at exp(-10) = 4.5e-05, an
exponent at 1e-3 or 4) is where L-BFGS-B stopped because it could go no further, not a minimum the data chose; a
bootstrap band over many orders of magnitude says the same of the refits. Each warning names what to add.
Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from adaptive.errors import AdaptiveError
from adaptive.record import record
from adaptive.scaling import state
from adaptive.scaling.fit_law import BOUNDS, LOG_DECAY_BOUNDS, LOG_MULTIPLIER_BOUNDS, JointFit, interval
from adaptive.scaling.grid import WIDTHS, SweepSettings, points_for

AT_BOUND = 1e-3  # within this fraction of a bound's range of the bound: at it
BAND_ORDERS = 3.0  # a 5-95% band wider than 10^3 times: the sweep does not pin the coefficient
SMALLEST, LARGEST = "smallest", "largest"


@record
class SweepWarning:
    """One thing the sweep does not pin, in words (`text`); an edge optimum also names its point."""

    text: str
    arch: str | None = None
    budget: float | None = None
    width: int | None = None  # the budget's best width, at the edge
    side: str | None = None  # SMALLEST or LARGEST
    add_widths: tuple[int, ...] = ()  # the ladder's next widths beyond the edge


def _sizes_reaching(settings: SweepSettings, arch: str, budget: float, widths: tuple[int, ...]) -> int | None:
    """The smallest --sizes above the sweep's whose grid at `budget` trains one of `widths`, or None."""
    for sizes in range(settings.sizes + 1, len(WIDTHS) + 1):
        try:
            planned = points_for(arch, budget, dataclasses.replace(settings, sizes=sizes, seeds=1))
        except AdaptiveError:  # the budget cannot train that many sizes
            return None
        if any(p.width in widths for p in planned):
            return sizes
    return None


def edge_optima(sweep: dict[str, Any]) -> list[SweepWarning]:
    """Each (arch, budget) whose lowest loss (the mean of its seeds) is at its smallest or largest width trained."""
    settings = SweepSettings.from_dict(sweep["settings"])
    losses: dict[tuple[str, float], dict[int, list[float]]] = {}
    for p in state.results(sweep):
        losses.setdefault((p["arch"], p["budget"]), {}).setdefault(p["width"], []).append(p["eval_loss"])
    out = []
    for (arch, budget), by_width in sorted(losses.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if len(by_width) < 2:
            continue  # one width: no curve, no edge
        best = min(by_width, key=lambda w: float(np.mean(by_width[w])))
        if best not in (min(by_width), max(by_width)):
            continue
        side = SMALLEST if best == min(by_width) else LARGEST
        beyond = [w for w in WIDTHS if w < best] if side == SMALLEST else [w for w in WIDTHS if w > best]
        add = tuple(beyond[-2:] if side == SMALLEST else beyond[:2])
        where = "below" if side == SMALLEST else "above"
        head = (f"{arch}, budget {budget:.3g} FLOPs: best width {best} is the {side} swept, so the optimum may lie "
                f"{where} it")
        if not add:
            text = (f"{head}; the ladder has no width {where} {best}: "
                    f"{'raise' if side == SMALLEST else 'lower'} this budget instead")
        else:
            sizes = _sizes_reaching(settings, arch, budget, add)
            how = (f"rerun into a new --out with --sizes {sizes}" if sizes is not None else
                   f"a wider model gets too few steps at this budget: add budgets above {budget:.3g}")
            text = f"{head}; add widths {where} {best} (e.g. {', '.join(map(str, add))}): {how}"
        out.append(SweepWarning(text, arch, budget, best, side, add))
    return out


def _log_bounds(fit: JointFit) -> list[tuple[str, float, float, tuple[float, float], str]]:
    """(name, value, value as the fit sees it, its bounds there, what pins it) for every fitted coefficient."""
    (a_lo_hi, b_lo_hi, e_lo_hi, alpha_lo_hi, beta_lo_hi) = BOUNDS
    rows = [("E", fit.E, math.log(fit.E), e_lo_hi, "budgets"), ("A", fit.A, math.log(fit.A), a_lo_hi, "sizes"),
            ("alpha", fit.alpha, fit.alpha, alpha_lo_hi, "sizes"), ("B", fit.B, math.log(fit.B), b_lo_hi, "budgets"),
            ("beta", fit.beta, fit.beta, beta_lo_hi, "budgets")]
    rows += [(f"k {arch}", k, math.log(k), LOG_MULTIPLIER_BOUNDS, "sizes")
             for arch, k in fit.multipliers.items() if arch != fit.reference]
    if fit.repeat_decay is not None:
        rows.append(("R_D*", fit.repeat_decay, math.log(fit.repeat_decay), LOG_DECAY_BOUNDS, "budgets"))
    return rows


def _refit_values(name: str, refits: list[JointFit]) -> list[float]:
    if name.startswith("k "):
        return [r.multipliers[name[2:]] for r in refits]
    if name == "R_D*":
        return [r.repeat_decay for r in refits if r.repeat_decay is not None]
    return [getattr(r, name) for r in refits]


def coefficient_warnings(fit: JointFit, refits: list[JointFit], budgets: tuple[float, ...],
                         sizes: int) -> list[SweepWarning]:
    """A coefficient at its bound, or whose 5-95% band (of the log-scale ones: E, A, B, k, R_D*) spans more than
    BAND_ORDERS orders of magnitude; each says what the sweep needs more of."""
    top = max(budgets)
    advice = {"budgets": f"add budgets above {top:.3g} (e.g. {2 * top:.3g}, {4 * top:.3g})",
              "sizes": f"add sizes (--sizes {sizes + 2} into a new --out)"}
    out = []
    for name, value, seen, (lo, hi), pins in _log_bounds(fit):
        reasons = []
        shown = (lambda v: f"{math.exp(v):.2g}") if name not in ("alpha", "beta") else (lambda v: f"{v:.3g}")
        if seen - lo <= AT_BOUND * (hi - lo):
            reasons.append(f"at its lower bound ({shown(lo)}), where the fit stopped")
        elif hi - seen <= AT_BOUND * (hi - lo):
            reasons.append(f"at its upper bound ({shown(hi)}), where the fit stopped")
        values = _refit_values(name, refits)
        if values and name not in ("alpha", "beta") and min(values) > 0:
            band_lo, band_hi = interval(values)
            orders = math.log10(band_hi / band_lo)
            if orders > BAND_ORDERS:
                reasons.append(f"its 5-95% band spans {orders:.0f} orders of magnitude ({band_lo:.2g} to {band_hi:.2g})")
        if reasons:
            out.append(SweepWarning(f"{name} = {value:.3g}: {'; '.join(reasons)}. The sweep does not pin it, and "
                                    f"predictions away from its points are guesses: {advice[pins]}"))
    return out


def diagnose(sweep: dict[str, Any], law: Any) -> list[SweepWarning]:
    """Every edge optimum of `sweep`, then every coefficient of `law` (a SweepLaw) the sweep does not pin."""
    sizes = int(sweep["settings"]["sizes"])
    return [*edge_optima(sweep), *coefficient_warnings(law.fit, law.bootstrap, law.budgets, sizes)]


__all__ = ["AT_BOUND", "BAND_ORDERS", "LARGEST", "SMALLEST", "SweepWarning", "coefficient_warnings", "diagnose",
           "edge_optima"]
