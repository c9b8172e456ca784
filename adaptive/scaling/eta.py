"""How long the rest of a sweep will take, from the points already run.

A sweep's points differ in size (each budget doubles the last, by default), so a flat mean of the finished
points' times says little about the next budget's. A point's time is modelled as a fixed start-up (a child
process, its imports, the model's init and the eval, whatever its size) plus a time per token it trains, both
fitted by least squares on the finished points:

    seconds_i = overhead + per_token * tokens_i

Per token, not per FLOP: at a sweep's widths (16-128) a step's fixed costs (the optimizer, Python, many small
matmuls) outweigh its arithmetic, so a budget's narrow points, which train more tokens on the same FLOPs, take
longer. On the README's sweep (2026-12-07, 2 CPU cores), after its first budget's 3 points this predicted 182 s
for the 181 s the other 6 took; per FLOP it said 270 s.

With one size finished (points within ONE_SIZE of each other) nothing splits the two terms, and all of the time is
counted per token (the remaining points are as large or larger, so this errs long, not short). The functions take
any measure of a point's size; the CLI gives tokens. Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import Sequence

from adaptive.record import record

ONE_SIZE = 1.25  # points whose sizes are within this ratio of each other are one size: nothing to fit a line on


@record
class TimeModel:
    """seconds = overhead_s + per_unit_s x size (a point's tokens, for the CLI), fitted on the finished points."""

    overhead_s: float
    per_unit_s: float

    def seconds(self, size: float) -> float:
        return self.overhead_s + self.per_unit_s * size


def time_model(finished: Sequence[tuple[float, float]]) -> TimeModel | None:
    """The model fitted on `finished` ((size, seconds) per point); None when no point has finished.

    Least squares for both terms when the points span more than one size; when that gives a negative overhead, the
    line through the origin (time proportional to size); when it gives a negative slope (noise over a narrow span),
    the mean time as the overhead alone."""
    if not finished:
        return None
    n = len(finished)
    sizes = [x for x, _ in finished]
    secs = [s for _, s in finished]
    if max(sizes) < ONE_SIZE * min(sizes):  # one size: nothing separates the start-up from the work
        return TimeModel(0.0, sum(secs) / sum(sizes))
    mean_x, mean_s = sum(sizes) / n, sum(secs) / n
    spread = sum((x - mean_x) ** 2 for x in sizes)
    slope = sum((x - mean_x) * (s - mean_s) for x, s in finished) / spread
    if slope < 0:
        return TimeModel(mean_s, 0.0)
    overhead = mean_s - slope * mean_x
    if overhead < 0:
        return TimeModel(0.0, sum(x * s for x, s in finished) / sum(x * x for x in sizes))
    return TimeModel(overhead, slope)


def eta_seconds(finished: Sequence[tuple[float, float]], remaining: Sequence[float], jobs: int = 1) -> float | None:
    """Seconds until the points of `remaining` (their sizes) are trained, `jobs` side by side, as `finished`
    ((size, seconds) per point, timed `jobs` side by side too) predict; None before any point has finished."""
    model = time_model(finished)
    if model is None:
        return None
    return sum(model.seconds(x) for x in remaining) / max(1, min(jobs, len(remaining) or 1))


def duration(seconds: float) -> str:
    """`seconds` in words a progress line can hold: 45 s, 3 min 20 s, 1 h 05 min."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


__all__ = ["ONE_SIZE", "TimeModel", "duration", "eta_seconds", "time_model"]
