"""How sure a plan is: the headroom kept free on every GPU, and a fitting peak within TIGHT_MARGIN of capacity.

Both come from the largest under-prediction of a measured peak among the corpus runs of our stack's kind
(adaptive/plan/evidence/corpus_runs.json, entries with stack_kind "ours" and a published peak, exemptions
aside). tests/plan/evidence/test_corpus.py recomputes both from the corpus and fails if these constants drift.

- Headroom: a candidate fits only if its predicted peak leaves this much of the GPU free. A run whose peak is
  under-predicted by u (predicted = (1 - u) x measured) needs predicted <= (1 - u) x capacity to stay in
  memory, so the default fraction is the largest u, rounded up to a whole percent. `--headroom` sets it (GiB or
  a percentage); 0 plans against the raw capacity (what the corpus's fit/OOM calls check: the prediction itself).
- Tight: a plan fitting the raw capacity within TIGHT_MARGIN of it (only possible with a headroom below the
  default). What decides a tight plan is the largest part alive at the peak moment: the one to shrink first.
"""

from __future__ import annotations

import math
import re
from typing import Iterable

from adaptive.errors import AdaptiveError
from adaptive.plan.hardware.gpus import format_gib
from adaptive.record import record

# predicted/measured - 1 of gist-llama7b-a800-z3-mb2-gb64: 66.08 GiB predicted, 75.7 GiB measured (-12.7%)
UNDERPREDICTION_SOURCE = "gist-llama7b-a800-z3-mb2-gb64 (corpus_runs.json): 75.7 GiB measured, 66.1 GiB predicted"
TIGHT_MARGIN = 0.13
DEFAULT_HEADROOM_FRACTION = 0.13  # headroom_from_underpredictions over the corpus (tests/plan/evidence/test_corpus.py)

# parts alive during the whole step, and those of each peak phase
_WHOLE_STEP = ("params", "optimizer", "zero3_grad_partition", "hpz_secondary_params")
_PHASE = {"backward": ("activations", "attention_scores", "logits_and_loss", "backward_transient",
                       "zero3_live_params", "accumulated_grads", "comm_buckets"),
          "optimizer_step": ("grads", "optimizer_transient", "step_flatten")}


def headroom_from_underpredictions(errors: Iterable[float]) -> float:
    """The default headroom, a fraction of capacity: the largest under-prediction u = -(predicted/measured - 1)
    among `errors`, rounded up to a whole percent (0 when no peak is under-predicted)."""
    worst = max((-e for e in errors), default=0.0)
    return math.ceil(round(max(worst, 0.0) * 100, 6)) / 100


@record
class Headroom:
    """GPU memory every plan keeps free: a fraction of capacity, or a fixed amount (`gib`)."""

    fraction: float = 0.0
    gib: float | None = None
    given: bool = False  # --headroom; else the corpus's default (or 0 from a library caller)

    def bytes_of(self, capacity_bytes: int) -> int:
        return round(self.gib * 2**30) if self.gib is not None else round(self.fraction * capacity_bytes)

    def words(self, capacity_bytes: int) -> str:
        """ "13% (5.20 GiB)" or "2.00 GiB" """
        if self.gib is not None:
            return format_gib(self.bytes_of(capacity_bytes))
        return f"{self.fraction * 100:g}% ({format_gib(self.bytes_of(capacity_bytes))})"


DEFAULT_HEADROOM = Headroom(fraction=DEFAULT_HEADROOM_FRACTION)
NO_HEADROOM = Headroom()
_HEADROOM_TEXT = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(%|gib)?", re.IGNORECASE)


def parse_headroom(text: str | None) -> Headroom:
    """--headroom: GiB ("2", "2GiB") or a percentage of the GPU's memory ("10%"); None: the corpus's default."""
    if text is None:
        return DEFAULT_HEADROOM
    m = _HEADROOM_TEXT.fullmatch(text.strip())
    if not m:
        raise AdaptiveError(f"--headroom {text!r} is not GiB or a percentage: give e.g. 2 (GiB) or 10%")
    value = float(m.group(1))
    if m.group(2) == "%":
        if value >= 100:
            raise AdaptiveError(f"--headroom {text} must be below 100% of the GPU's memory, e.g. 10%")
        return Headroom(fraction=value / 100, given=True)
    return Headroom(gib=value, given=True)


def is_tight(peak_bytes: int, capacity_bytes: int, margin: float = TIGHT_MARGIN) -> bool:
    """Fits, but not by the margin."""
    return peak_bytes <= capacity_bytes < peak_bytes * (1 + margin)


def deciding_part(parts: dict[str, int], phase: str) -> str:
    """The largest part alive at the peak moment."""
    alive = {k: parts.get(k, 0) for k in _WHOLE_STEP + _PHASE[phase]}
    return max(alive, key=lambda k: alive[k])


__all__ = ["DEFAULT_HEADROOM", "DEFAULT_HEADROOM_FRACTION", "Headroom", "NO_HEADROOM", "TIGHT_MARGIN",
           "UNDERPREDICTION_SOURCE", "deciding_part", "headroom_from_underpredictions", "is_tight", "parse_headroom"]
