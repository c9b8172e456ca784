"""The best run a budget buys: the model shape, arch and token count with the lowest predicted final loss.

For each arch, the size ladder (architecture/ladder.py: the presets' shape rules) is planned on the given GPUs
like any `fit`; the planner's own tokens/s and price turn the budget into the tokens each shape can train, and
the loss model (quality/) predicts the loss they buy. The global batch follows DeepSeek LLM's compute-optimal
B_opt unless pinned. Only shapes near the compute-optimal size are planned (a few per arch), and the loss is
unimodal along the ladder, so a budget answers in a fraction of a second.
"""

from __future__ import annotations

import math
from dataclasses import replace

from adaptive.errors import AdaptiveError
from adaptive.plan.architecture.ladder import ladder
from adaptive.plan.architecture.params import count_params
from adaptive.plan.architecture.presets import ARCHS, ModelSpec, spec_from_shape
from adaptive.plan.quality.hyperparams import optimal_batch_tokens
from adaptive.plan.quality.predict import predict, resolve_law
from adaptive.plan.quality.ranking import LossComparison, compare_quality
from adaptive.plan.search.planner import FitRequest, Plan, fit, host_mem_for, hyperparams_for
from adaptive.record import record

MIN_STEPS = 100  # a run shorter than this many optimizer steps is not a training run
WORSE_IN_A_ROW = 2  # the ladder stops after this many larger shapes with a higher loss


@record
class Budget:
    """What the user can spend; every limit given applies (the tightest decides)."""

    usd: float | None = None
    gpu_hours: float | None = None
    days: float | None = None

    def hours(self, world_size: int, price_per_gpu_hour: float) -> float:
        """Wall-clock hours on `world_size` GPUs."""
        limits = []
        if self.usd is not None:
            if price_per_gpu_hour <= 0:
                raise AdaptiveError("--budget-usd needs a GPU price; this GPU costs $0/hour (--price): give "
                                    "--budget-gpu-hours or --budget-days")
            limits.append(self.usd / (world_size * price_per_gpu_hour))
        if self.gpu_hours is not None:
            limits.append(self.gpu_hours / world_size)
        if self.days is not None:
            limits.append(self.days * 24.0)
        return min(limits)

    def describe(self) -> str:
        parts = [f"${self.usd:,.0f}" if self.usd is not None else None,
                 f"{self.gpu_hours:,.0f} GPU-hours" if self.gpu_hours is not None else None,
                 f"{self.days:g} days" if self.days is not None else None]
        return " and ".join(p for p in parts if p)


@record
class BudgetResult:
    budget: Budget
    hours: float  # wall-clock hours the budget buys on the request's GPUs
    best: Plan  # the lowest predicted loss
    by_arch: tuple[Plan, ...]  # the best plan of each arch, lowest loss first (best among them)
    planned: int  # shapes planned
    batch_pinned: bool = False  # the global batch was --global-batch-tokens, not B_opt
    largest_tried: bool = False  # the winner is the largest model it could try: a larger one might do better
    versus_best: tuple[LossComparison, ...] = ()  # the best against each other arch's best: lower, or a tie

    @property
    def ties(self) -> tuple[LossComparison, ...]:
        """The archs the law cannot tell from the winner."""
        return tuple(v for v in self.versus_best if v.tie)


def batch_for_flops(flops: float, seq_len: int, world_size: int) -> int:
    """DeepSeek's B_opt at `flops`, rounded to a power-of-two number of sequences (at least one per GPU)."""
    sequences = 2 ** round(math.log2(max(1.0, optimal_batch_tokens(flops) / seq_len)))
    return seq_len * max(sequences, world_size)


def global_batch_for(spec: ModelSpec, tokens: float, seq_len: int, world_size: int) -> int:
    """B_opt at this run's own compute (the planner's hyperparams_for: C = M D), rounded as batch_for_flops."""
    return batch_for_flops(hyperparams_for(spec, tokens, seq_len).flops, seq_len, world_size)


@record
class _Point:
    """One shape on the ladder: its plan at the batch it trains with, the tokens the budget buys, their loss."""

    plan: Plan
    tokens: float
    loss: float


MODEL_STATE_BYTES = 16  # per parameter: 16-bit weights and gradients, fp32 master weights, Adam's m and v


def cannot_fit(req: FitRequest) -> bool:
    """True when the model states alone exceed every GPU's and every host's memory together: no ZeRO stage or
    offload can fit it (a bound that needs no search)."""
    room = req.world_size * req.gpu.memory_bytes + req.num_nodes * host_mem_for(req)
    return MODEL_STATE_BYTES * count_params(req.spec).total > room


def _point(req: FitRequest, hours: float) -> _Point | None:
    """The shape's plan and the tokens `hours` buy; None when it does not fit or the budget buys fewer than
    MIN_STEPS steps."""
    if cannot_fit(req):
        return None
    plan = fit(req, suggest=False)
    if not plan.fits:
        return None
    tokens = plan.shown.throughput.tokens_per_second * hours * 3600.0
    if tokens < MIN_STEPS * plan.global_batch_tokens:
        return None
    loss = predict(req.spec, plan.counts, tokens, req.loss_model, req.unique_tokens, req.seq_len).predicted_loss
    return _Point(plan, tokens, loss)


def _final(point: _Point, hours: float, pinned: bool) -> Plan:
    """The shape's plan at B_opt of its own compute (unless the batch is pinned) and the tokens it then trains."""
    req = point.plan.request
    if pinned:
        return fit(replace(req, train_tokens=point.tokens), suggest=False)
    batch = global_batch_for(req.spec, point.tokens, req.seq_len, req.world_size)
    plan = fit(replace(req, global_batch_tokens=batch), suggest=False)
    if not plan.fits:
        return fit(replace(req, train_tokens=point.tokens), suggest=False)
    tokens = plan.shown.throughput.tokens_per_second * hours * 3600.0
    return fit(replace(req, global_batch_tokens=batch, train_tokens=tokens), suggest=False)


ROUGH_MFU = 0.4  # to size the search's start and its batch; each shape then runs at its own planned speed


def budget_flops(req: FitRequest, hours: float) -> float:
    return hours * 3600.0 * req.world_size * req.gpu.peak_tflops * 1e12 * ROUGH_MFU


def ladder_specs(archs: tuple[str, ...] = ARCHS, vocab_size: int = 32000) -> dict[str, list[ModelSpec]]:
    """The size ladder built as each arch, smallest first."""
    shapes = ladder(vocab_size=vocab_size)
    return {arch: [spec_from_shape(s, arch) for s in shapes] for arch in archs}


def search_budget(req: FitRequest, budget: Budget, candidates: dict[str, list[ModelSpec]] | None = None,
                  max_params: float | None = None) -> BudgetResult:
    """The plan with the lowest predicted loss within `budget`; AdaptiveError when it buys no model.
    `candidates`: arch -> the models to try, smallest first (default: the size ladder as every arch); one model
    asks only how many tokens the budget buys it."""
    hours = budget.hours(req.world_size, req.gpu.price_per_hour)
    flops = budget_flops(req, hours)
    start = (req.loss_model or resolve_law(None)).dense.optimal_split(flops)[0]  # where to start on the ladder
    pinned = req.global_batch_tokens is not None
    # the shapes are ranked at one batch, B_opt of the budget's compute; the winners are re-planned at their own
    batch = req.global_batch_tokens if pinned else batch_for_flops(flops, req.seq_len, req.world_size)
    candidates = candidates if candidates is not None else ladder_specs(vocab_size=req.spec.vocab_size)
    best_by_arch: list[Plan] = []
    largest: dict[str, ModelSpec] = {}
    planned = 0
    for specs in candidates.values():
        if max_params is not None:
            specs = [s for s in specs if count_params(s).total <= max_params]
        if not specs:
            continue
        if len(specs) > 1:  # a search, not one given model
            largest[specs[0].arch] = specs[-1]
        # from the rung nearest the compute-optimal size, walk up, then down, while the loss keeps improving
        first = min(range(len(specs)), key=lambda i: abs(math.log(count_params(specs[i]).active / start)))
        found: list[_Point] = []
        for up, direction in ((True, range(first, len(specs))), (False, range(first - 1, -1, -1))):
            worse, best_loss = 0, math.inf
            for i in direction:
                point = _point(replace(req, spec=specs[i], train_tokens=None, global_batch_tokens=batch), hours)
                planned += 1
                if point is None:  # too big for the GPUs, or too slow to train MIN_STEPS: only larger is worse
                    worse += up
                else:
                    found.append(point)
                    worse = 0 if point.loss < best_loss else worse + 1
                    best_loss = min(best_loss, point.loss)
                if worse >= WORSE_IN_A_ROW:
                    break
        if found:
            top = min(found, key=lambda p: p.loss)
            best_by_arch.append(_final(top, hours, pinned))
    if not best_by_arch:
        cap = f" with at most {max_params:.3g} parameters" if max_params is not None else ""
        raise AdaptiveError(f"a budget of {budget.describe()} ({hours:.3g} h on {req.world_size} x {req.gpu.name}) "
                            f"buys no model{cap}: none of the ladder's shapes that fit trains {MIN_STEPS} steps in it; "
                            "raise the budget or use more GPUs")
    ranked = tuple(sorted(best_by_arch, key=lambda p: p.quality.predicted_loss))
    best = ranked[0]
    versus = tuple(compare_quality(best.request.spec.arch, best.quality, p.request.spec.arch, p.quality)
                   for p in ranked[1:])
    return BudgetResult(budget=budget, hours=hours, best=best, by_arch=ranked, planned=planned, batch_pinned=pinned,
                        largest_tried=best.request.spec == largest.get(best.request.spec.arch), versus_best=versus)
