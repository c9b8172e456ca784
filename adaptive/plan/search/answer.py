"""`fit`'s answer in one line: the verdict, what decided it, the peak against capacity, and (when it fits) the
time and cost.

    b7 dense on 1 x a100-40gb: DOES NOT FIT: CPU offload needs 161.87 GiB host RAM, 120.00 GiB assumed (--host-mem);
    GPU 30.59/40.00 GiB

What decides a plan that does not fit, first match wins:
- "pin": the search with one pinned knob (or all of them) released fits on these GPUs: the pin forced it;
- "host": the closest configuration fits the GPU, but its offload needs more host RAM than given or assumed;
- "headroom": the closest configuration fits the GPU's memory, but not what the headroom leaves (tight.py);
- "gpu": the smallest peak exceeds the GPU.
Pure functions over the plan's dataclasses (`answer(plan)`, `budget_answer(result)`, `first_line(either)`); the CLI
renders `Answer.line` and nothing else decides it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adaptive.plan.hardware.gpus import format_gib, gib_figure
from adaptive.plan.search.planner import Candidate, Plan, offload_name
from adaptive.record import record

if TYPE_CHECKING:  # a plain `fit` does not import the budget search
    from adaptive.plan.finetune.method import Finetune
    from adaptive.plan.search.budget import BudgetResult


@record
class Answer:
    """The plan's title, its verdict, what decided it (gpu | host | headroom | pin; "fits" for a fit) and the words
    after the verdict."""

    title: str
    fits: bool
    decided_by: str
    reason: str

    @property
    def verdict(self) -> str:
        return "FITS" if self.fits else "DOES NOT FIT"

    @property
    def line(self) -> str:
        return f"{self.title}: {self.verdict}: {self.reason}"


def method_words(ft: Finetune) -> str:
    """ "full fine-tune", or "QLoRA fine-tune (rank 16, alpha 32, all-linear)" """
    if not ft.adapted:
        return "full fine-tune"
    return f"{'QLoRA' if ft.quantized else 'LoRA'} fine-tune (rank {ft.lora_rank}, alpha {ft.alpha:g}, {ft.lora_targets})"


def title(plan: Plan) -> str:
    """ "b7 dense on 1 x a100-40gb", ", QLoRA fine-tune (rank 16, alpha 32, all-linear)" added for a fine-tune """
    req, ft = plan.request, plan.request.finetune
    what = "" if ft is None else f", {method_words(ft)}"
    return f"{req.spec.name} {req.spec.arch}{what} on {req.world_size} x {req.gpu.name}"


def duration(hours: float) -> str:
    """ "45 min", "12.5 h", "12.3 days" """
    if hours < 1:
        return f"{hours * 60:.0f} min"
    if hours < 48:
        return f"{hours:.1f} h"
    return f"{hours / 24:.1f} days"


def gpu_words(plan: Plan, c: Candidate) -> str:
    """ "GPU 30.59/40.00 GiB (headroom 5.20 GiB kept)" """
    req = plan.request
    kept = plan.headroom_bytes
    return (f"GPU {gib_figure(c.memory.peak_gpu_bytes)}/{format_gib(req.gpu.memory_bytes)}"
            + (f" (headroom {format_gib(kept)} kept)" if kept else ""))


def brief(c: Candidate) -> str:
    """ "ZeRO-2 + offload optimizer, micro-batch 8, checkpointing (38.10 GiB)" """
    s = c.setup
    off = offload_name(s)
    ckpt = {"off": "", "full": ", checkpointing"}.get(s.checkpointing, f", checkpointing {s.checkpointing}")
    return (f"ZeRO-{s.zero_stage}{'' if off == 'none' else f' + offload {off}'}, micro-batch {s.micro_batch_size}"
            f"{ckpt} ({format_gib(c.memory.peak_gpu_bytes)})")


def answer(plan: Plan) -> Answer:
    """The first line's words after "MODEL ARCH on N x GPU: "."""
    req, c, head = plan.request, plan.shown, title(plan)
    if plan.fits:
        return Answer(head, True, "fits", f"{gpu_words(plan, c)}, {duration(plan.hours)}, {usd(plan.cost)}")
    if plan.released is not None:
        pins, freed = plan.released
        text = (f"{' '.join(pins)} rule{'s' if len(pins) == 1 else ''} out every fit "
                f"(without {'it' if len(pins) == 1 else 'them'}: {brief(freed)})")
        return Answer(head, False, "pin", f"{text}; {gpu_words(plan, c)}")
    m = c.memory
    pinned = f"; pinned: {', '.join(plan.pinned)}" if plan.pinned else ""
    if c.fits_gpu:
        where = "NVMe offload's pinned buffers need" if c.setup.offload_device == "nvme" else "CPU offload needs"
        how = "assumed" if req.host_mem_bytes is None else "given"
        text = f"{where} {format_gib(m.host_bytes_per_node)} host RAM, {format_gib(plan.host_mem_bytes)} {how} (--host-mem)"
        return Answer(head, False, "host", f"{text}; {gpu_words(plan, c)}{pinned}")
    if c.fits_capacity:
        h = req.headroom
        text = (f"the peak fits the GPU but not the headroom {h.words(req.gpu.memory_bytes)} "
                f"({'--headroom' if h.given else 'the default: --headroom 0 plans against the whole GPU'})")
        return Answer(head, False, "headroom", f"{text}; {gpu_words(plan, c)}{pinned}")
    return Answer(head, False, "gpu", f"GPU memory: the smallest peak exceeds the GPU; {gpu_words(plan, c)}{pinned}")


def budget_answer(result: BudgetResult) -> Answer:
    """A budget search's first line: what the budget buys (the winner, its tokens and loss), its peak, time, cost."""
    best = result.best
    req, spec, q = best.request, best.request.spec, best.quality
    loss = f", loss {q.predicted_loss:.3f} ({q.band[0]:.3f}-{q.band[1]:.3f})" if q is not None else ""
    return Answer(f"{result.budget.describe()} on {req.world_size} x {req.gpu.name}", True, "fits",
                  f"{spec.name} {spec.arch} on {best.train_tokens / 1e9:,.1f}B tokens{loss}; "
                  f"{gpu_words(best, best.shown)}, {duration(best.hours)}, {usd(best.cost)}")


def first_line(result: Plan | BudgetResult) -> Answer:
    """A plan's answer, or a budget search's."""
    return answer(result) if isinstance(result, Plan) else budget_answer(result)


def headroom_note(plan: Plan) -> str | None:
    """ "headroom 13% (5.20 GiB) ruled out: ZeRO-2, micro-batch 8 (38.10 GiB)" where the headroom cost a faster
    configuration (one that fits the whole GPU and its host RAM); None where it cost nothing."""
    if not plan.ruled_out:
        return None
    req = plan.request
    return (f"headroom {req.headroom.words(req.gpu.memory_bytes)} ruled out: "
            + "; ".join(brief(c) for c in plan.ruled_out))


def usd(dollars: float) -> str:
    """Dollars as the plan's cost row shows them: cents below $100 (a fine-tune's $0.66), whole dollars above."""
    return f"${dollars:,.2f}" if dollars < 100 else f"${dollars:,.0f}"


__all__ = ["Answer", "answer", "brief", "budget_answer", "first_line", "duration", "gpu_words", "headroom_note", "title",
           "usd"]
