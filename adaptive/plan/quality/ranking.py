"""Which of two predicted losses is lower, or whether the law cannot tell (a tie), said in words.

With a law fitted on your data (`adaptive scale`'s joint law), both predictions come from the same bootstrap
refits, index by index, so their gap has its own band: the 5-95% of the paired gaps, widened (in quadrature) by
what one run of each adds: the law's residual scatter around its points (seed noise and what the shared shape
misses), 1.645 x sqrt(2) x its rmse of log-loss. The band is then where the gap two runs show should fall; a pair
whose band holds zero is a tie. With a published law there are no paired refits: a pair is a tie when either
prediction lies within the other's band. Pure Python (the planner imports no numpy).
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

from adaptive.record import record

Z_BAND = 1.645  # a normal's 5-95%
MIN_PAIRED = 10  # fewer refits than this: the bands decide


def interval(values: Sequence[float]) -> tuple[float, float]:
    """The 5-95% of `values`, interpolated between order statistics as numpy's default does."""
    cuts = statistics.quantiles(values, n=20, method="inclusive")  # 5%, 10%, ..., 95%
    return cuts[0], cuts[-1]


@record
class LossComparison:
    """Two predictions side by side: which is lower, by how much (relative), and whether that is a tie."""

    lower: str  # the label of the lower predicted loss
    higher: str
    gap: float  # (higher - lower) / lower at the centres
    band: tuple[float, float] | None  # 5-95% of the paired relative gap; None when the bands decided
    tie: bool

    def words(self) -> str:
        if self.band is None:
            how = "their bands overlap" if self.tie else "their bands do not overlap"
        else:
            how = f"the law puts two runs' gap at {self.band[0]:+.2%} to {self.band[1]:+.2%}"
        if self.tie:
            return f"{self.lower} and {self.higher} tie: {self.gap:.2%} apart, and {how}"
        return f"{self.lower} is lower than {self.higher} by {self.gap:.2%} ({how})"


def compare_losses(label_a: str, center_a: float, band_a: tuple[float, float], samples_a: Sequence[float],
                   label_b: str, center_b: float, band_b: tuple[float, float], samples_b: Sequence[float],
                   residual: float = 0.0) -> LossComparison:
    """a against b. `samples_*` are the predictions under the same law's bootstrap refits, in refit order (empty
    for a published law); paired when both have as many, at least MIN_PAIRED. `residual`: the law's rmse of
    log-loss around its points, the scatter one run adds to each side."""
    flip = center_b < center_a
    if flip:
        label_a, center_a, band_a, samples_a, label_b, center_b, band_b, samples_b = (
            label_b, center_b, band_b, samples_b, label_a, center_a, band_a, samples_a)
    gap = (center_b - center_a) / center_a
    if len(samples_a) >= MIN_PAIRED and len(samples_a) == len(samples_b):
        lo, hi = interval([(b - a) / a for a, b in zip(samples_a, samples_b)])
        runs = Z_BAND * math.sqrt(2.0) * residual
        band = (gap - math.hypot(gap - lo, runs), gap + math.hypot(hi - gap, runs))
        return LossComparison(label_a, label_b, gap, band, tie=band[0] <= 0.0)
    tie = band_b[0] <= center_a <= band_b[1] or band_a[0] <= center_b <= band_a[1]
    return LossComparison(label_a, label_b, gap, None, tie)


def compare_quality(label_a: str, a, label_b: str, b) -> LossComparison:
    """compare_losses on two `predict.Quality`s (paired only when one law file's refits made both)."""
    same_law = bool(a.refits_of) and a.refits_of == b.refits_of
    return compare_losses(label_a, a.predicted_loss, a.band, a.samples if same_law else (),
                          label_b, b.predicted_loss, b.band, b.samples if same_law else (),
                          max(a.residual, b.residual) if same_law else 0.0)


__all__ = ["LossComparison", "compare_losses", "compare_quality", "interval"]
