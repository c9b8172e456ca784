"""isoflop.png: per architecture, the measured isoFLOP points with the law's curves through them (top), and the
compute-optimal size N_opt(C) the law gives, beside each budget's best measured point (bottom).

Budgets the law was not fitted on (held out) are drawn with open markers. matplotlib's Agg backend: no display.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from adaptive.scaling.fit_law import Fit
from adaptive.scaling.frontier import curve, optimum
from adaptive.scaling.grid import Candidate


def draw(path: Path, points: Sequence[dict[str, Any]], fits: dict[str, Fit], cands: dict[str, list[Candidate]],
         held_out: Sequence[float] = ()) -> Path:
    """Draw `points` (sweep.json's done points) and `fits` (per arch) into `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    archs = [a for a in fits]
    fig, axes = plt.subplots(2, len(archs), figsize=(6.5 * len(archs), 8.5), squeeze=False)
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
        span = np.exp(np.linspace(np.log(budgets[0] / 2), np.log(budgets[-1] * 2), 60))
        for budget in span:
            frontier_n.append(optimum(fit, budget, cands[arch]).params)
        opt_at = [optimum(fit, b, cands[arch]) for b in budgets]
        top.plot([o.params for o in opt_at], [o.loss for o in opt_at], "k--", lw=1, label="law's optimum")
        bottom.plot(span, frontier_n, "k-", lw=1, label="law: N_opt(C)")
        top.set(xscale="log", xlabel="active parameters N (embeddings included)", ylabel="final eval loss (nats/token)")
        top.set_title(f"{arch}: isoFLOP curves (law: alpha {fit.alpha:.2f}, beta {fit.beta:.2f}, E {fit.E:.2f})",
                      fontsize=10)
        bottom.set(xscale="log", yscale="log", xlabel="compute C (FLOPs)", ylabel="N",
                   ylim=(min(lo, min(frontier_n)) / 1.3, max(hi, max(frontier_n)) * 1.3))
        bottom.set_title(f"{arch}: compute-optimal size N_opt(C) (dots: each budget's best point)", fontsize=10)
        top.legend(fontsize=8)
        bottom.legend(fontsize=8)
        top.grid(alpha=0.3, which="both")
        bottom.grid(alpha=0.3, which="both")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


__all__ = ["draw"]
