"""How long the rest of a sweep will take, from the points already run.

A sweep's points differ in size (each budget doubles the last, by default), so a flat mean of the finished
points' times says little about the next budget's. A point's time is modelled as a fixed start-up (a child
process, its imports, the model's init and the eval, whatever its size) plus a time per FLOP it
trains, both fitted by least squares on the finished points:

    seconds_i = overhead + per_flop * flops_i

With one finished size (one budget's points) there is nothing to split the two, and all of it is counted per FLOP (the remaining
points are as large or larger, so this errs long, not short). Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import Sequence

from adaptive.record import record

ONE_SIZE = 1.25  # points within this ratio of FLOPs are one size (a budget's points train it to within half a step)


@record
class TimeModel:
    """seconds = overhead_s + per_flop_s x flops, fitted on the finished points."""

    overhead_s: float
    per_flop_s: float

    def seconds(self, flops: float) -> float:
        return self.overhead_s + self.per_flop_s * flops


def time_model(finished: Sequence[tuple[float, float]]) -> TimeModel | None:
    """The model fitted on `finished` ((flops, seconds) per point); None when no point has finished.

    Least squares for both terms when the points span more than one size; when that gives a negative overhead, the
    line through the origin (time proportional to FLOPs); when it gives a negative slope (noise over a narrow span),
    the mean time as the overhead alone."""
    if not finished:
        return None
    n = len(finished)
    flops = [f for f, _ in finished]
    secs = [s for _, s in finished]
    mean_f, mean_s = sum(flops) / n, sum(secs) / n
    if max(flops) < ONE_SIZE * min(flops):  # one budget's points: nothing separates the start-up from the work
        return TimeModel(0.0, sum(secs) / sum(flops))
    spread = sum((f - mean_f) ** 2 for f in flops)
    slope = sum((f - mean_f) * (s - mean_s) for f, s in finished) / spread
    if slope < 0:
        return TimeModel(mean_s, 0.0)
    overhead = mean_s - slope * mean_f
    if overhead < 0:
        return TimeModel(0.0, sum(f * s for f, s in finished) / sum(f * f for f in flops))
    return TimeModel(overhead, slope)


def eta_seconds(finished: Sequence[tuple[float, float]], remaining: Sequence[float], jobs: int = 1) -> float | None:
    """Seconds until the points of `remaining` (their FLOPs) are trained, `jobs` side by side, as `finished`
    ((flops, seconds) per point, timed `jobs` side by side too) predict; None before any point has finished."""
    model = time_model(finished)
    if model is None:
        return None
    return sum(model.seconds(f) for f in remaining) / max(1, min(jobs, len(remaining) or 1))


def duration(seconds: float) -> str:
    """`seconds` in words a progress line can hold: 45 s, 3 min 20 s, 1 h 05 min."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


__all__ = ["ONE_SIZE", "TimeModel", "duration", "eta_seconds", "time_model"]
