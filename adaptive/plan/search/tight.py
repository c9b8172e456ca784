"""How sure a plan is: a fitting peak within TIGHT_MARGIN of capacity is "tight".

The margin is the largest under-prediction of a measured peak among the corpus runs of our stack's kind
(adaptive/plan/evidence/corpus_runs.json, entries with stack_kind "ours" and a published peak, exemptions
aside): a plan this close to capacity could OOM by that much. tests/plan/evidence/test_corpus.py recomputes it
from the corpus and fails if this constant drifts. What decides a tight plan is the largest part alive
at the peak moment: the one to shrink first.
"""

from __future__ import annotations

TIGHT_MARGIN = 0.13  # gist-llama7b-a800-z3-mb2-gb64: 75.7 GiB measured, 66.1 GiB predicted (-12.7%)

# parts alive during the whole step, and those of each peak phase
_WHOLE_STEP = ("params", "optimizer", "zero3_grad_partition", "hpz_secondary_params")
_PHASE = {"backward": ("activations", "attention_scores", "logits_and_loss", "backward_transient",
                       "zero3_live_params", "accumulated_grads", "comm_buckets"),
          "optimizer_step": ("grads", "optimizer_transient", "step_flatten")}


def is_tight(peak_bytes: int, capacity_bytes: int, margin: float = TIGHT_MARGIN) -> bool:
    """Fits, but not by the margin."""
    return peak_bytes <= capacity_bytes < peak_bytes * (1 + margin)


def deciding_part(parts: dict[str, int], phase: str) -> str:
    """The largest part alive at the peak moment."""
    alive = {k: parts.get(k, 0) for k in _WHOLE_STEP + _PHASE[phase]}
    return max(alive, key=lambda k: alive[k])


__all__ = ["TIGHT_MARGIN", "is_tight", "deciding_part"]
