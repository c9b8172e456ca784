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


__all__ = ["Optimum", "best_of", "curve", "flops_per_token_at", "loss_at", "optimum"]
