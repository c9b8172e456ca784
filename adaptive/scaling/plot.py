"""isoflop.png: per architecture, the measured isoFLOP points with the law's curves through them (top), and the
compute-optimal size N_opt(C) the law gives, beside each budget's best measured point (bottom).

Budgets the law was not fitted on (held out) are drawn with open markers. A budget whose best point sits at the edge
of its widths is ringed in red and labelled with the widths to add; every warning (diagnose.py) is written under the
panels, and the title says there are some. matplotlib's Agg backend: no display.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from adaptive.scaling.diagnose import SMALLEST, SweepWarning
from adaptive.scaling.fit_law import Fit
from adaptive.scaling.frontier import curve, optimum
from adaptive.scaling.grid import Candidate


EDGE_COLOR = "red"
NOTE_WIDTH = 100  # characters per line of the warnings under the panels (monospace 7.5 pt in a 6.5-inch column)


def draw(path: Path, points: Sequence[dict[str, Any]], fits: dict[str, Fit], cands: dict[str, list[Candidate]],
         held_out: Sequence[float] = (), warnings: Sequence[SweepWarning] = ()) -> Path:
    """Draw `points` (sweep.json's done points), `fits` (per arch) and `warnings` into `path`."""
    import matplotlib.pyplot as plt

    fig = figure(points, fits, cands, held_out, warnings)
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def figure(points: Sequence[dict[str, Any]], fits: dict[str, Fit], cands: dict[str, list[Candidate]],
           held_out: Sequence[float] = (), warnings: Sequence[SweepWarning] = ()) -> Any:
    """The figure draw() saves (a matplotlib Figure; the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    archs = [a for a in fits]
    notes = [line for w in warnings for line in textwrap.wrap("! " + w.text, NOTE_WIDTH * len(archs),
                                                              subsequent_indent="  ")]
    note_in = 0.14 * len(notes) + (0.3 if notes else 0.0)  # inches of text under the panels
    fig, axes = plt.subplots(2, len(archs), figsize=(6.5 * len(archs), 8.5 + note_in), squeeze=False)
    budgets = sorted({p["budget"] for p in points})
    colors = plt.cm.viridis(np.linspace(0.0, 0.85, max(len(budgets), 1)))
    for col, arch in enumerate(archs):
        fit, top, bottom = fits[arch], axes[0][col], axes[1][col]
        mine = [p for p in points if p["arch"] == arch]
        lo = min(p["params"] for p in mine) / 1.5
        hi = max(p["params"] for p in mine) * 1.5
        lo = max(lo, cands[arch][0].params)  # the law's FLOPs per token are known over the ladder's shapes only
        grid = np.exp(np.linspace(np.log(lo), np.log(hi), 200))
        frontier_n = []
        for color, budget in zip(colors, budgets):
            at = sorted((p for p in mine if p["budget"] == budget), key=lambda p: p["params"])
            if not at:
                continue
            held = budget in held_out
            top.plot([p["params"] for p in at], [p["eval_loss"] for p in at], "o", color=color,
                     mfc="none" if held else color, label=f"C={budget:.2g}" + (" (held out)" if held else ""))
            top.plot(grid, curve(fit, budget, grid, cands[arch]), "-", color=color, lw=1)
            best = min(at, key=lambda p: p["eval_loss"])
            bottom.plot(budget, best["params"], "o", color=color, mfc="none" if held else color)
            edge = next((w for w in warnings if w.arch == arch and w.budget == budget and w.width), None)
            if edge is not None:
                ringed = [p for p in at if p["width"] == edge.width]
                n, loss = ringed[0]["params"], min(p["eval_loss"] for p in ringed)
                top.plot(n, loss, "o", ms=14, mfc="none", mec=EDGE_COLOR, mew=2)
                bottom.plot(budget, n, "o", ms=14, mfc="none", mec=EDGE_COLOR, mew=2)
                where = "below" if edge.side == SMALLEST else "above"
                top.annotate(f"best at the edge: add widths {where} {edge.width}", (n, loss), fontsize=7,
                             color=EDGE_COLOR, xytext=(-10 if edge.side == SMALLEST else 10, 12),
                             textcoords="offset points", ha="left" if edge.side == SMALLEST else "right")
        span = np.exp(np.linspace(np.log(budgets[0] / 2), np.log(budgets[-1] * 2), 60))
        for budget in span:
            frontier_n.append(optimum(fit, budget, cands[arch]).params)
        opt_at = [optimum(fit, b, cands[arch]) for b in budgets]
        top.plot([o.params for o in opt_at], [o.loss for o in opt_at], "k--", lw=1, label="law's optimum")
        bottom.plot(span, frontier_n, "k-", lw=1, label="law: N_opt(C)")
        top.set(xscale="log", xlabel="active parameters N (embeddings included)", ylabel="final eval loss (nats/token)")
        top.set_title(f"{arch}: isoFLOP curves (law: alpha {fit.alpha:.2f}, beta {fit.beta:.2f}, E {fit.E:.3g})",
                      fontsize=10)
        bottom.set(xscale="log", yscale="log", xlabel="compute C (FLOPs)", ylabel="N",
                   ylim=(min(lo, min(frontier_n)) / 1.3, max(hi, max(frontier_n)) * 1.3))
        bottom.set_title(f"{arch}: compute-optimal size N_opt(C) (dots: each budget's best point)", fontsize=10)
        top.legend(fontsize=8)
        bottom.legend(fontsize=8)
        top.grid(alpha=0.3, which="both")
        bottom.grid(alpha=0.3, which="both")
    if notes:
        title = (f"warning: the sweep does not pin this law ({len(warnings)} note(s) below; red rings: a budget's best "
                 "point at the edge of its widths)")
        fig.suptitle("\n".join(textwrap.wrap(title, 80 * len(archs))), color=EDGE_COLOR, fontsize=10)
        fig.text(0.01, 0.01, "\n".join(notes), fontsize=7.5, color=EDGE_COLOR, va="bottom", ha="left",
                 family="monospace", bbox={"facecolor": "white", "edgecolor": EDGE_COLOR, "alpha": 0.9})
    fig.tight_layout(rect=(0.0, note_in / (8.5 + note_in), 1.0, 0.95 if notes else 1.0))
    return fig


__all__ = ["draw", "figure"]
