"""Fit L(N, D) = E + A/N^alpha + B/D^beta to (N, D, loss) points, as Chinchilla's approach 3 did.

Hoffmann et al. 2022 (section 3.3, appendix D.2): minimise the Huber loss (delta 1e-3) of
LSE(a - alpha log N, b - beta log D, e) - log L over the points, with L-BFGS from a grid of starting points,
and keep the best; E = exp(e), A = exp(a), B = exp(b). Fitting log-loss weighs every point alike, and the
Huber loss keeps one bad point from pulling the fit. The gradient is analytic (the LSE's softmax weights).
The bootstrap refits points resampled with replacement; their spread is the law's confidence band.

N is what the law counts (N_DEFINITION): active parameters with the embeddings. At a sweep's sizes the
embedding and LM head are most of the model; Pearce & Song 2024 ("Reconciling Kaplan and Chinchilla scaling
laws", arXiv 2406.12907) traced Kaplan's different exponents to leaving them out at small sizes, and found
Chinchilla's when counting them. Active, not total: an MoE's compute follows the experts a token uses.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from adaptive.errors import AdaptiveError
from adaptive.record import record

N_DEFINITION = "active"  # adaptive.plan.quality.laws.N_ACTIVE
HUBER_DELTA = 1e-3  # Hoffmann et al. 2022, appendix D.2
# starting points: Hoffmann et al.'s grid (alpha, beta in 0..2 by 0.5, e in -1..1.5 by 0.5, a, b in 0..25 by 5),
# thinned to 108 starts, so that a fit takes about a second
ALPHAS = (0.3, 1.0)
E_STARTS = (-1.0, 0.5, 1.5)
LOG_COEFF_STARTS = (0.0, 8.0, 20.0)
BOUNDS = [(-20.0, 60.0), (-20.0, 60.0), (-10.0, 5.0), (1e-3, 4.0), (1e-3, 4.0)]  # a, b, e, alpha, beta
MIN_POINTS = 5  # five coefficients
# the Huber loss of log-loss residuals has gradients of ~1e-3 at most: scipy's default gtol (1e-5) stops far from
# the minimum
TOLERANCES = {"gtol": 1e-12, "ftol": 1e-15, "maxiter": 5000}


@record
class Fit:
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    rmse_log: float  # root mean square of log(predicted) - log(measured)
    points: int

    @property
    def coefficients(self) -> tuple[float, float, float, float, float]:
        return (self.E, self.A, self.B, self.alpha, self.beta)

    def loss(self, n: float, d: float) -> float:
        return law_loss(self.coefficients, n, d)


def law_loss(coefficients: tuple[float, ...], n: float, d: float) -> float:
    """E + A / N^alpha + B / D^beta for (E, A, B, alpha, beta) (a bootstrap refit's), N and D scalars or arrays."""
    e, a, b, alpha, beta = coefficients
    return e + a / n**alpha + b / d**beta


def _objective(theta: np.ndarray, x: np.ndarray, y: np.ndarray, log_loss: np.ndarray) -> tuple[float, np.ndarray]:
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * x, b - beta * y, np.full_like(x, e)])  # [3, points]
    top = terms.max(axis=0)
    weights = np.exp(terms - top)
    total = weights.sum(axis=0)
    lse = top + np.log(total)
    weights /= total  # d lse / d term
    r = lse - log_loss
    small = np.abs(r) <= HUBER_DELTA
    value = np.where(small, 0.5 * r * r, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA)).sum()
    dr = np.clip(r, -HUBER_DELTA, HUBER_DELTA)  # d huber / d r
    grad = np.array([(dr * weights[0]).sum(), (dr * weights[1]).sum(), (dr * weights[2]).sum(),
                     -(dr * weights[0] * x).sum(), -(dr * weights[1] * y).sum()])
    return float(value), grad


def _starts() -> list[np.ndarray]:
    return [np.array([a, b, e, alpha, beta]) for alpha, beta, e, a, b in
            itertools.product(ALPHAS, ALPHAS, E_STARTS, LOG_COEFF_STARTS, LOG_COEFF_STARTS)]


def _best(x: np.ndarray, y: np.ndarray, log_loss: np.ndarray, starts: list[np.ndarray]) -> np.ndarray:
    from scipy.optimize import minimize

    best, best_value = None, math.inf
    for theta0 in starts:
        res = minimize(_objective, theta0, args=(x, y, log_loss), jac=True, method="L-BFGS-B", bounds=BOUNDS,
                       options=TOLERANCES)
        if np.all(np.isfinite(res.x)) and res.fun < best_value:
            best, best_value = res.x, res.fun
    assert best is not None, "every start failed"
    return best


def _as_fit(theta: np.ndarray, x: np.ndarray, y: np.ndarray, log_loss: np.ndarray) -> Fit:
    a, b, e, alpha, beta = (float(v) for v in theta)
    fit = Fit(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=alpha, beta=beta, rmse_log=0.0, points=len(x))
    predicted = np.log([fit.loss(math.exp(n), math.exp(d)) for n, d in zip(x, y)])
    return Fit(**{**fit.__dict__, "rmse_log": float(np.sqrt(np.mean((predicted - log_loss) ** 2)))})


def _arrays(params: list[float], tokens: list[float], losses: list[float]) -> tuple[np.ndarray, ...]:
    if not len(params) == len(tokens) == len(losses):
        raise AdaptiveError("params, tokens and losses must be as many")
    if len(params) < MIN_POINTS:
        raise AdaptiveError(f"a law has {MIN_POINTS} coefficients and needs at least {MIN_POINTS} points that "
                            f"trained, got {len(params)}")
    values = np.array([params, tokens, losses], dtype=float)
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise AdaptiveError("every point needs positive, finite params, tokens and loss")
    return np.log(values[0]), np.log(values[1]), np.log(values[2])


def fit_law(params: list[float], tokens: list[float], losses: list[float]) -> Fit:
    """The best fit over the grid of starting points."""
    x, y, log_loss = _arrays(params, tokens, losses)
    return _as_fit(_best(x, y, log_loss, _starts()), x, y, log_loss)


def bootstrap(params: list[float], tokens: list[float], losses: list[float], fit: Fit, samples: int = 100,
              seed: int = 0) -> list[tuple[float, float, float, float, float]]:
    """Refits on `samples` resamplings (with replacement) of the points, each started from the full fit and a
    few grid points. A resample with fewer than MIN_POINTS distinct points is drawn again."""
    x, y, log_loss = _arrays(params, tokens, losses)
    rng = np.random.default_rng(seed)
    center = np.array([math.log(fit.A), math.log(fit.B), math.log(fit.E), fit.alpha, fit.beta])
    starts = [center, *_starts()[::54]]  # the full fit, and 2 more of the grid
    out = []
    while len(out) < samples:
        pick = rng.integers(0, len(x), len(x))
        if len(set(pick.tolist())) < MIN_POINTS:
            continue
        theta = _best(x[pick], y[pick], log_loss[pick], starts)
        a, b, e, alpha, beta = (float(v) for v in theta)
        out.append((math.exp(e), math.exp(a), math.exp(b), alpha, beta))
    return out


def interval(values: list[float], low: float = 0.05, high: float = 0.95) -> tuple[float, float]:
    """The [low, high] quantiles of `values` (the band the planner shows: 5-95%)."""
    return float(np.quantile(values, low)), float(np.quantile(values, high))


__all__ = ["Fit", "HUBER_DELTA", "N_DEFINITION", "bootstrap", "fit_law", "interval", "law_loss"]
