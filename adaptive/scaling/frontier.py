"""What a fitted law says about compute budgets: the loss of a shape at a budget, the best of several shapes,
and the compute-optimal frontier N_opt(C).

A budget buys C / flops_per_token tokens; at these sizes flops_per_token is not 6N (the LM head and attention
are a large share), so the frontier follows the planner's count over the ladder's shapes, interpolated in
log-log between them, instead of Chinchilla's closed form (which assumes C = 6ND).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from adaptive.record import record
from adaptive.scaling.fit_law import Fit
from adaptive.scaling.grid import Candidate


@record
class Optimum:
    budget: float
    params: float
    tokens: float
    loss: float


def flops_per_token_at(params: float | np.ndarray, cands: Sequence[Candidate]) -> np.ndarray:
    """FLOPs per token of a model with `params` (the law's N), interpolated over the ladder's shapes."""
    n = np.log([c.params for c in cands])
    f = np.log([c.flops_per_token for c in cands])
    return np.exp(np.interp(np.log(params), n, f))


def loss_at(fit: Fit, params: float, flops_per_token: float, budget: float) -> float:
    return fit.loss(params, budget / flops_per_token)


def best_of(fit: Fit, shapes: Sequence[tuple[float, float]], budget: float) -> float:
    """The law's best loss at `budget` over `shapes` ((params, flops_per_token) each): what the sweep's best
    point at that budget should measure."""
    return min(loss_at(fit, n, f, budget) for n, f in shapes)


def optimum(fit: Fit, budget: float, cands: Sequence[Candidate], grid: int = 400) -> Optimum:
    """The loss-minimising size at `budget` within the ladder's range of sizes."""
    params = np.exp(np.linspace(math.log(cands[0].params), math.log(cands[-1].params), grid))
    tokens = budget / flops_per_token_at(params, cands)
    losses = fit.loss(params, tokens)
    i = int(np.argmin(losses))
    return Optimum(budget, float(params[i]), float(tokens[i]), float(losses[i]))


def curve(fit: Fit, budget: float, params: np.ndarray, cands: Sequence[Candidate]) -> np.ndarray:
    """The law's isoFLOP curve: loss against `params` at `budget`."""
    tokens = budget / flops_per_token_at(params, cands)
    return fit.loss(params, tokens)




def compute_multiplier(fit: Fit, cands: Sequence[Candidate], reference: Fit, reference_cands: Sequence[Candidate],
                       budget: float) -> float:
    """How many times `budget` the reference arch needs to reach the loss `fit`'s arch reaches at `budget`, each at
    its own compute-optimal size on the ladder (isoFLOP, with each arch's own FLOPs per token): the arch's compute
    multiplier at this budget (> 1: it is worth more compute than it spends)."""
    target = optimum(fit, budget, cands).loss
    lo, hi = math.log(budget) - 12.0, math.log(budget) + 12.0  # a factor of e^12 either way
    if optimum(reference, math.exp(hi), reference_cands).loss > target:
        return math.inf
    if optimum(reference, math.exp(lo), reference_cands).loss < target:
        return 0.0
    for _ in range(60):  # the reference's optimal loss falls with compute: bisect in log C
        mid = 0.5 * (lo + hi)
        if optimum(reference, math.exp(mid), reference_cands).loss > target:
            lo = mid
        else:
            hi = mid
    return math.exp(0.5 * (lo + hi)) / budget


__all__ = ["Optimum", "best_of", "compute_multiplier", "curve", "flops_per_token_at", "loss_at", "optimum"]
