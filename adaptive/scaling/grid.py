"""The isoFLOP grid: for each architecture and compute budget, a few model sizes around the expected optimum.

A point's shapes come from the planner's size ladder (`ladder.rung`: the presets' rules) at tiny widths, made
into the architecture by `spec_from_shape`, so a point is a model the recipes could train. Its compute is the
planner's own count (`model_flops_per_token`: 6 per matmul parameter per token, attention and the LM head
included) times the tokens it trains, so tokens = C / flops_per_token, rounded to whole optimizer steps.

Sizes are centred on the size that would see ~20 tokens per parameter (Hoffmann et al. 2022's rule), the
prior; the fit does not need the minimum to fall in the middle, only points on both sides of the curve help
it. Pure: no torch, no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from adaptive.errors import AdaptiveError, unknown
from adaptive.plan.architecture.ladder import ffn_for, layers_for, rung
from adaptive.plan.architecture.params import count_params
from adaptive.plan.architecture.presets import ARCHS, Shape, spec_from_shape
from adaptive.plan.estimate.throughput import model_flops_per_token
from adaptive.record import record

WIDTHS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
SINGLE_HEAD_BELOW = 32  # the ladder's head size is 32 below width 256; narrower models get one head as wide
MIN_STEPS = 20  # fewer optimizer steps than this is warmup, not training
PRIOR_TOKENS_PER_PARAM = 20.0  # Hoffmann et al. 2022: where the sizes are centred


@record
class SweepSettings:
    """What a sweep trains; sweep.json keeps it, and a rerun must ask for the same sweep."""

    archs: tuple[str, ...]
    budgets: tuple[float, ...]  # FLOPs per point, the planner's count
    sizes: int  # model sizes per budget
    dataset: str
    seq_len: int
    seed: int
    lr: float
    micro_batch: int  # sequences per optimizer step (one process, no accumulation)
    vocab_size: int
    seeds: int = 1  # runs per point, seeds seed, seed + 1, ...: the fit sees their mean and spread
    tokenizer: str | None = None  # a local HF tokenizer folder; None: the built-in BPE
    text_field: str = "text"  # the column of a .jsonl/.parquet/saved dataset that holds the text

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len

    def as_dict(self) -> dict[str, Any]:
        return {"archs": list(self.archs), "budgets": list(self.budgets), "sizes": self.sizes,
                "dataset": self.dataset, "seq_len": self.seq_len, "seed": self.seed, "lr": self.lr,
                "micro_batch": self.micro_batch, "vocab_size": self.vocab_size, "seeds": self.seeds,
                "tokenizer": self.tokenizer, "text_field": self.text_field}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SweepSettings:
        return cls(**{**d, "archs": tuple(d["archs"]), "budgets": tuple(float(b) for b in d["budgets"])})


@record
class Point:
    """One run of the sweep: a shape as an arch, trained for `steps` steps."""

    arch: str
    budget: float  # the budget it belongs to
    width: int
    layers: int
    params: int  # active parameters, embeddings included (the law's N; see fit_law.N_DEFINITION)
    total_params: int
    flops_per_token: float
    steps: int
    tokens: int
    flops: float  # what it trains: tokens x flops_per_token (within half a step of the budget)
    replica: int = 0  # which of the point's seeds: it trains with the sweep's seed + replica

    @property
    def shape_name(self) -> str:
        """The point without its seed: what the fit averages over."""
        return f"{self.arch}-c{self.budget:.3g}-w{self.width}".replace("+", "")

    @property
    def name(self) -> str:
        return self.shape_name + (f"-s{self.replica}" if self.replica else "")


@record
class Candidate:
    width: int
    layers: int
    params: int
    total_params: int
    flops_per_token: float


def shape_for(width: int, vocab_size: int, seq_len: int) -> Shape:
    """The ladder's shape at `width`; below 32 wide (where its 32-wide heads do not fit) one head, 2 layers."""
    shape = rung(max(width, SINGLE_HEAD_BELOW), vocab_size=vocab_size, max_position_embeddings=max(seq_len, 128))
    if width >= SINGLE_HEAD_BELOW:
        return shape
    return dataclasses.replace(shape, name=f"w{width}", hidden_size=width, intermediate_size=ffn_for(width),
                               num_hidden_layers=layers_for(width), num_attention_heads=1, num_key_value_heads=1)


def candidates(arch: str, vocab_size: int, seq_len: int) -> list[Candidate]:
    """The ladder's tiny shapes as `arch`, smallest first."""
    out = []
    for width in WIDTHS:
        shape = shape_for(width, vocab_size, seq_len)
        spec = spec_from_shape(shape, arch)
        counts = count_params(spec)
        out.append(Candidate(width, shape.num_hidden_layers, counts.active, counts.total,
                             model_flops_per_token(spec, seq_len)))
    return out


def spec_for(arch: str, width: int, vocab_size: int, seq_len: int) -> Any:
    """The ModelSpec a point trains (what `point` builds and the recipe plans)."""
    return spec_from_shape(shape_for(width, vocab_size, seq_len), arch)


def check(settings: SweepSettings) -> None:
    """One line naming the bad value: an unknown arch, a budget that is not a positive number, too few sizes."""
    if not settings.archs:
        raise AdaptiveError("--arch names no architecture; give one or more of " + ", ".join(ARCHS))
    for arch in settings.archs:
        if arch not in ARCHS:
            raise unknown("--arch", arch, ARCHS)
    if len(set(settings.archs)) != len(settings.archs):
        raise AdaptiveError(f"--arch names an architecture twice: {','.join(settings.archs)}")
    if len(settings.budgets) < 2:
        raise AdaptiveError(f"--budgets needs at least 2 compute budgets for a law, got {len(settings.budgets)}")
    for c in settings.budgets:
        if not math.isfinite(c) or c <= 0:
            raise AdaptiveError(f"--budgets must be positive FLOP counts, got {c:g}")
    if len(set(settings.budgets)) != len(settings.budgets):
        raise AdaptiveError("--budgets names a budget twice")
    if settings.sizes < 2:
        raise AdaptiveError(f"--sizes must be at least 2 (a curve per budget), got {settings.sizes}")
    if settings.seeds < 1:
        raise AdaptiveError(f"--seeds must be at least 1, got {settings.seeds}")
    if settings.sizes > len(WIDTHS):
        raise AdaptiveError(f"--sizes must be at most {len(WIDTHS)} (the ladder's tiny widths), got {settings.sizes}")


def points_for(arch: str, budget: float, settings: SweepSettings) -> list[Point]:
    """`settings.sizes` shapes around the prior optimum at `budget`, each trained to the budget."""
    per_step = settings.tokens_per_step
    usable = []
    for c in candidates(arch, settings.vocab_size, settings.seq_len):
        steps = round(budget / c.flops_per_token / per_step)
        if steps >= MIN_STEPS:
            usable.append((c, steps))
    if len(usable) < settings.sizes:
        smallest = candidates(arch, settings.vocab_size, settings.seq_len)[settings.sizes - 1]
        need = MIN_STEPS * per_step * smallest.flops_per_token
        raise AdaptiveError(f"--budgets {budget:.3g} is too small for {settings.sizes} {arch} sizes: each needs "
                            f"{MIN_STEPS} steps of {per_step} tokens; give at least {need:.2g} FLOPs")
    prior = min(range(len(usable)), key=lambda i: abs(math.log(usable[i][1] * per_step / usable[i][0].params
                                                               / PRIOR_TOKENS_PER_PARAM)))
    start = min(max(0, prior - settings.sizes // 2), len(usable) - settings.sizes)
    chosen = usable[start:start + settings.sizes]
    return [Point(arch=arch, budget=budget, width=c.width, layers=c.layers, params=c.params,
                  total_params=c.total_params, flops_per_token=c.flops_per_token, steps=steps,
                  tokens=steps * per_step, flops=steps * per_step * c.flops_per_token, replica=replica)
            for replica in range(settings.seeds) for c, steps in chosen]


def plan_grid(settings: SweepSettings) -> list[Point]:
    """Every point of the sweep, budgets smallest first (the cheap ones finish first), each budget's archs
    together (a sweep stopped early has every arch's small budgets), a budget's first seed before its others."""
    check(settings)
    return [p for budget in sorted(settings.budgets) for arch in settings.archs
            for p in points_for(arch, budget, settings)]


__all__ = ["Candidate", "MIN_STEPS", "Point", "SweepSettings", "WIDTHS", "candidates", "check", "plan_grid",
           "points_for", "spec_for"]
