"""One plan per model x arch x GPU, side by side, each with the reason when it does not fit."""

from __future__ import annotations

from dataclasses import dataclass

from adaptive.plan.quality.ranking import LossComparison, compare_quality
from adaptive.plan.search.planner import Plan, fit, offload_name
from adaptive.plan.request import make_request


@dataclass(frozen=True)
class Row:
    plan: Plan
    best_quality: bool = False  # lowest predicted final loss among rows that fit (the same model on other GPUs too)
    best_speed: bool = False  # most tokens/s among rows that fit
    best_cost: bool = False  # lowest cost per 1B tokens among rows that fit
    cheapest: bool = False  # lowest cost of the whole run among rows that fit
    best_value: bool = False  # most loss reduction per extra dollar over the cheapest run (best_value())
    quality_tie: LossComparison | None = None  # another model against the lowest loss, when the law cannot split them


def compare(models: list[str], archs: list[str], gpu_names: list[str], **request_kwargs) -> list[Row]:
    plans = [fit(make_request(model=m, arch=a, gpu=g, **request_kwargs), suggest=False)
             for m in models for a in archs for g in gpu_names]
    fitting = [p for p in plans if p.fits]
    predicted = [p for p in fitting if p.quality is not None]  # a fine-tune predicts no loss
    quality = min(predicted, key=lambda p: p.quality.predicted_loss, default=None)
    speed = max(fitting, key=lambda p: p.shown.throughput.tokens_per_second, default=None)
    cost = min(fitting, key=lambda p: p.cost / p.train_tokens, default=None)
    cheapest = min(fitting, key=lambda p: p.cost, default=None)
    value = best_value(predicted)
    return [Row(p, quality is not None and same_run(p, quality) and p.fits, p is speed, p is cost, p is cheapest,
                p is value, quality_tie(p, quality)) for p in plans]


def label(plan: Plan) -> str:
    """The model a loss belongs to: the GPUs train the same loss from the same model and tokens."""
    return f"{plan.request.spec.name} {plan.request.spec.arch}"


def same_run(a: Plan, b: Plan) -> bool:
    """The same model trained on the same tokens, whatever the GPUs: the same predicted loss."""
    return a.request.spec == b.request.spec and a.train_tokens == b.train_tokens


def quality_tie(plan: Plan, best: Plan | None) -> LossComparison | None:
    """Another model against the one with the lowest predicted loss, when the law calls the pair a tie (ranking.py);
    else None. The best model on other GPUs is no tie: it is the same loss (its row is best_quality too)."""
    if best is None or not plan.fits or same_run(plan, best):
        return None
    verdict = compare_quality(label(best), best.quality, label(plan), plan.quality)
    return verdict if verdict.tie else None


def best_value(fitting: list[Plan]) -> Plan | None:
    """The best loss per dollar: of the runs with a lower predicted loss than the cheapest run, the one that buys
    the most loss reduction per extra dollar spent over it; the cheapest run when none is better."""
    if not fitting:
        return None
    base = min(fitting, key=lambda p: (p.cost, p.quality.predicted_loss))
    better = [p for p in fitting if p.quality.predicted_loss < base.quality.predicted_loss]
    if not better:
        return base
    return max(better, key=lambda p: (base.quality.predicted_loss - p.quality.predicted_loss)
               / max(p.cost - base.cost, 1e-9))


# the knobs a request can pin, as (FitRequest field, flag)
_PINS = (("zero_stage", "--zero"), ("offload", "--offload"), ("micro_batch_size", "--micro-batch"),
         ("grad_accum", "--grad-accum"), ("gradient_checkpointing", "--checkpointing"),
         ("checkpointing", "--checkpoint-policy"), ("ep_size", "--ep-size"), ("tp_size", "--tp-size"),
         ("sp_size", "--sp-size"), ("zero_hpz", "--zero-hpz"), ("zero_quantized_weights", "--zero-quantize"))


def pinned_flags(plan: Plan) -> list[str]:
    """The knobs the request pinned (the planner searched only the rest)."""
    return [flag for name, flag in _PINS if getattr(plan.request, name) is not None]


def why_not(plan: Plan) -> tuple[str | None, str]:
    """Why a plan does not fit: (`gpu_memory` | `host_ram` | `pinned` | None, one line saying it with the figures).

    The closest configuration tells: when one fits the GPU, host RAM for its CPU offload is what is
    short; otherwise the smallest peak exceeds the GPU. `pinned` says the limit met is one of pinned knobs
    (the planner could not try the others)."""
    if plan.fits:
        return None, ""
    c, gib = plan.closest, 2**30
    if c.fits_gpu:
        kind = "host_ram"
        text = (f"host RAM: CPU offload needs {c.memory.host_bytes_per_node / gib:.1f} GiB per node, "
                f"{plan.host_mem_bytes / gib:.1f} GiB available (--host-mem)")
    else:
        kind = "gpu_memory"
        text = (f"GPU memory: the smallest peak is {c.memory.peak_gpu_bytes / gib:.1f} GiB, "
                f"the GPU has {plan.request.gpu.memory_bytes / gib:.1f} GiB")
    pins = pinned_flags(plan)
    if pins:
        return "pinned", f"{text}, with {', '.join(pins)} pinned"
    return kind, text


def row_dict(row: Row) -> dict:
    p = row.plan
    c = p.shown
    s = c.setup
    why, why_text = why_not(p)
    return {
        "model": p.request.spec.name,
        "arch": p.request.spec.arch,
        "gpu": p.request.gpu.name,
        "num_gpus": p.request.world_size,
        "fits": p.fits,
        "fits_gpu": c.fits_gpu,
        "fits_host": c.fits_host,
        "why_not": why,  # gpu_memory | host_ram | pinned; None when it fits
        "why_not_detail": why_text,
        "params_total": p.counts.total,
        "params_active": p.counts.active,
        "zero_stage": s.zero_stage,
        "offload": offload_name(s),
        "micro_batch_size": s.micro_batch_size,
        "gradient_accumulation_steps": c.grad_accum,
        "seq_len": s.seq_len,
        "gradient_checkpointing": s.gradient_checkpointing,
        "checkpointing": s.checkpointing,  # off, full or the selective policy
        "tp_size": s.tp_size,
        "sp_size": s.sp_size,
        "peak_gpu_bytes": c.memory.peak_gpu_bytes,
        "gpu_capacity_bytes": p.request.gpu.memory_bytes,
        "host_bytes": c.memory.host_bytes_per_node,
        "host_capacity_bytes": p.host_mem_bytes,
        "tokens_per_second": c.throughput.tokens_per_second,
        "train_tokens": p.train_tokens,
        "train_hours": p.hours,
        "cost_usd": p.cost,
        "cost_per_1b_tokens_usd": p.cost / p.train_tokens * 1e9,
        "predicted_loss": p.quality.predicted_loss if p.quality else None,  # None: a fine-tune (quality_absent_reason)
        "loss_band": list(p.quality.band) if p.quality else None,
        "loss_law": p.quality.law if p.quality else None,
        "finetune": p.request.finetune.method if p.request.finetune else None,
        "best_quality": row.best_quality,
        "ties_best_quality": row.quality_tie is not None,  # the law cannot tell it from the lowest loss
        "quality_tie": row.quality_tie.words() if row.quality_tie else None,
        "best_speed": row.best_speed,
        "best_cost": row.best_cost,
        "cheapest": row.cheapest,
        "best_loss_per_dollar": row.best_value,
    }
