"""The honest version of the user's comparison tables: one plan per model x arch x GPU."""

from __future__ import annotations

from dataclasses import dataclass

from adaptive.plan.planner import Plan, fit
from adaptive.plan.request import make_request


@dataclass(frozen=True)
class Row:
    plan: Plan
    best_quality: bool = False  # most active params among rows that fit (a quality proxy)
    best_speed: bool = False  # most tokens/s among rows that fit
    best_cost: bool = False  # lowest cost per 1B tokens among rows that fit


def compare(models: list[str], archs: list[str], gpu_names: list[str], **request_kwargs) -> list[Row]:
    plans = [fit(make_request(model=m, arch=a, gpu=g, **request_kwargs), suggest=False)
             for m in models for a in archs for g in gpu_names]
    fitting = [p for p in plans if p.fits]
    quality = max(fitting, key=lambda p: p.counts.active, default=None)
    speed = max(fitting, key=lambda p: p.shown.throughput.tokens_per_second, default=None)
    cost = min(fitting, key=lambda p: p.cost / p.train_tokens, default=None)
    return [Row(p, p is quality, p is speed, p is cost) for p in plans]


def row_dict(row: Row) -> dict:
    p = row.plan
    c = p.shown
    s = c.setup
    return {
        "model": p.request.spec.name,
        "arch": p.request.spec.arch,
        "gpu": p.request.gpu.name,
        "num_gpus": p.request.world_size,
        "fits": p.fits,
        "params_total": p.counts.total,
        "params_active": p.counts.active,
        "zero_stage": s.zero_stage,
        "offload": "all" if s.offload_params else "optimizer" if s.offload_optimizer else "none",
        "micro_batch_size": s.micro_batch_size,
        "gradient_accumulation_steps": c.grad_accum,
        "seq_len": s.seq_len,
        "gradient_checkpointing": s.gradient_checkpointing,
        "peak_gpu_bytes": c.memory.peak_gpu_bytes,
        "tokens_per_second": c.throughput.tokens_per_second,
        "train_tokens": p.train_tokens,
        "train_hours": p.hours,
        "cost_usd": p.cost,
        "cost_per_1b_tokens_usd": p.cost / p.train_tokens * 1e9,
        "best_quality": row.best_quality,
        "best_speed": row.best_speed,
        "best_cost": row.best_cost,
    }
