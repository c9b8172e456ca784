"""Fit L(N, D) = E + A/N^alpha + B/D^beta to (N, D, loss) points, as Chinchilla's approach 3 did; one law across archs.

Hoffmann et al. 2022 (section 3.3, appendix D.2): minimise the Huber loss (delta 1e-3) of
LSE(a - alpha log N, b - beta log D, e) - log L over the points, with L-BFGS from a grid of starting points,
and keep the best; E = exp(e), A = exp(a), B = exp(b). Fitting log-loss weighs every point alike, and the
Huber loss keeps one bad point from pulling the fit. The gradient is analytic (the LSE's softmax weights).
The bootstrap refits points resampled with replacement; their spread is the law's confidence band.

Across architectures (fit_joint) the five coefficients are shared and each arch gets a multiplier k on N: a small
sweep cannot pin five coefficients per arch (they trade off and rank archs by noise), but it can pin one offset per
arch on a shared shape. Past two epochs of a small corpus, D becomes Muennighoff et al. 2023's effective data with
R_D* a sixth fitted coefficient.

N is what the law counts (N_DEFINITION): active parameters with the embeddings. At a sweep's sizes the
embedding and LM head are most of the model; Pearce & Song 2024 ("Reconciling Kaplan and Chinchilla scaling
laws", arXiv 2406.12907) traced Kaplan's different exponents to leaving them out at small sizes, and found
Chinchilla's when counting them. Active, not total: an MoE's compute follows the experts a token uses.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable

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
LOG_MULTIPLIER_BOUNDS = (-6.0, 6.0)  # an arch worth 1/400 to 400 times the reference's parameters
LOG_DECAY_BOUNDS = (math.log(0.05), math.log(500.0))  # R_D*: repeats worth nothing after a twentieth of an epoch ..
# worth almost fresh data
# below two epochs at most the decay has too little to be fitted on (Muennighoff et al.: up to 4 epochs are nearly
# as good as fresh data)
REPEAT_FIT_EPOCHS = 2.0
DECAY_STARTS = (15.387756, 2.0)  # Muennighoff et al.'s fit (quality/repeated_data.R_D_STAR), and a fast decay
MIN_POINTS = 5  # five coefficients
MIN_POINTS_PER_ARCH = 3  # a multiplier, and a check of the shared shape
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
    unique_tokens: float | None = None  # the corpus's training tokens, when the sweep repeated them
    repeat_decay: float | None = None  # R_D*, fitted: repeats beyond the first epoch are worth less (effective_tokens)

    @property
    def coefficients(self) -> tuple[float, float, float, float, float]:
        return (self.E, self.A, self.B, self.alpha, self.beta)

    def loss(self, n: float, d: float) -> float:
        return law_loss(self.coefficients, n, effective_tokens(d, self.unique_tokens, self.repeat_decay))


def effective_tokens(d, unique: float | None, decay: float | None):
    """Muennighoff et al. 2023's effective data past one epoch of U unique tokens (quality/repeated_data.py), for
    scalars or arrays; D itself without a decay."""
    if unique is None or decay is None:
        return d
    from adaptive.plan.quality.repeated_data import effective_tokens as fresh_equivalent

    out = np.vectorize(lambda x: fresh_equivalent(float(x), unique, decay), otypes=[float])(d)
    return float(out) if np.ndim(out) == 0 else out


def law_loss(coefficients: tuple[float, ...], n: float, d: float) -> float:
    """E + A / N^alpha + B / D^beta for (E, A, B, alpha, beta) (a bootstrap refit's), N and D scalars or arrays."""
    e, a, b, alpha, beta = coefficients
    return e + a / n**alpha + b / d**beta


def _objective(theta: np.ndarray, x: np.ndarray, y: np.ndarray, log_loss: np.ndarray, group: np.ndarray,
               unique: float | None = None) -> tuple[float, np.ndarray]:
    """The Huber loss of the log-loss residuals and its gradient; theta = (a, b, e, alpha, beta, log k_1, ...,
    [log R_D*]), `group` each point's arch (0: the reference, multiplier 1), whose N counts k times. With `unique`
    the last coefficient is log R_D*, and y (log D) becomes the log of the effective tokens."""
    dy = None
    if unique is not None:
        theta, decay = theta[:-1], math.exp(theta[-1])
        repeats = np.maximum(np.exp(y) / unique - 1.0, 0.0)
        fade = np.exp(-repeats / decay)
        effective = unique * (1.0 + decay * (1.0 - fade))
        # d log D' / d log R_D*, zero within the first epoch
        dy = np.where(repeats > 0, unique * decay * ((1.0 - fade) - repeats / decay * fade) / effective, 0.0)
        y = np.where(repeats > 0, np.log(effective), y)
    a, b, e, alpha, beta = theta[:5]
    log_k = np.concatenate([[0.0], theta[5:]])
    xe = x + log_k[group]  # log of the effective parameters
    terms = np.stack([a - alpha * xe, b - beta * y, np.full_like(x, e)])  # [3, points]
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
                     -(dr * weights[0] * xe).sum(), -(dr * weights[1] * y).sum()])
    by_arch = np.bincount(group, weights=-alpha * dr * weights[0], minlength=len(log_k))[1:]
    grad = np.concatenate([grad, by_arch])
    if dy is not None:
        grad = np.append(grad, -(beta * dr * weights[1] * dy).sum())
    return float(value), grad


def _starts(extra: int = 0) -> list[np.ndarray]:
    """Hoffmann et al.'s grid (thinned), every multiplier starting at 1."""
    return [np.array([a, b, e, alpha, beta, *([0.0] * extra)]) for alpha, beta, e, a, b in
            itertools.product(ALPHAS, ALPHAS, E_STARTS, LOG_COEFF_STARTS, LOG_COEFF_STARTS)]


def _best(x: np.ndarray, y: np.ndarray, log_loss: np.ndarray, group: np.ndarray,
          starts: list[np.ndarray], unique: float | None = None) -> np.ndarray:
    from scipy.optimize import minimize

    extra = len(starts[0]) - len(BOUNDS) - (unique is not None)
    bounds = BOUNDS + [LOG_MULTIPLIER_BOUNDS] * extra + ([LOG_DECAY_BOUNDS] if unique is not None else [])
    best, best_value = None, math.inf
    for theta0 in starts:
        res = minimize(_objective, theta0, args=(x, y, log_loss, group, unique), jac=True, method="L-BFGS-B",
                       bounds=bounds, options=TOLERANCES)
        if np.all(np.isfinite(res.x)) and res.fun < best_value:
            best, best_value = res.x, res.fun
    assert best is not None, "every start failed"
    return best


def _rmse(coefficients: tuple[float, ...], n: np.ndarray, d: np.ndarray, log_loss: np.ndarray) -> float:
    return float(np.sqrt(np.mean((np.log(law_loss(coefficients, n, d)) - log_loss) ** 2)))


def _coefficients(theta: np.ndarray) -> tuple[tuple[float, float, float, float, float], tuple[float, ...]]:
    """((E, A, B, alpha, beta), (k_1, ...)) of a parameter vector."""
    a, b, e, alpha, beta = (float(v) for v in theta[:5])
    return (math.exp(e), math.exp(a), math.exp(b), alpha, beta), tuple(math.exp(float(v)) for v in theta[5:])


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
    coefficients, _ = _coefficients(_best(x, y, log_loss, np.zeros(len(x), dtype=int), _starts()))
    return Fit(*coefficients, rmse_log=_rmse(coefficients, np.exp(x), np.exp(y), log_loss), points=len(x))


def bootstrap(params: list[float], tokens: list[float], losses: list[float], fit: Fit, samples: int = 100,
              seed: int = 0) -> list[tuple[float, float, float, float, float]]:
    """Refits on `samples` resamplings (with replacement) of the points, each started from the full fit and a
    few grid points. A resample with fewer than MIN_POINTS distinct points is drawn again."""
    x, y, log_loss = _arrays(params, tokens, losses)
    rng = np.random.default_rng(seed)
    group = np.zeros(len(x), dtype=int)
    starts = [_theta(fit), *_starts()[::54]]  # the full fit, and 2 more of the grid
    out = []
    while len(out) < samples:
        pick = rng.integers(0, len(x), len(x))
        if len(set(pick.tolist())) < MIN_POINTS:
            continue
        out.append(_coefficients(_best(x[pick], y[pick], log_loss[pick], group, starts))[0])
    return out


# --------------------------------------------------------------------------------------------------------------
# One law across architectures: shared E, A, B, alpha, beta, and a multiplier per arch on its effective parameters


@record
class JointFit:
    """L_arch(N, D) = E + A / (k_arch N)^alpha + B / D'^beta, k of the reference arch 1 (Clark et al. 2022's
    effective parameter count). At C = 6 N D, k_arch N parameters on D tokens is the reference arch on k_arch
    times the compute. D' is D, or past one epoch of the corpus's U unique tokens Muennighoff et al. 2023's
    effective data with R_D* fitted on the sweep (a small corpus is repeated many times at a sweep's budgets)."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    multipliers: dict[str, float]  # arch -> k, the reference's 1.0; in the sweep's arch order
    reference: str
    rmse_log: float
    points: int
    unique_tokens: float | None = None
    repeat_decay: float | None = None  # R_D*, fitted when some point repeated the corpus

    @property
    def coefficients(self) -> tuple[float, float, float, float, float]:
        return (self.E, self.A, self.B, self.alpha, self.beta)

    def for_arch(self, arch: str) -> Fit:
        """The arch's own Hoffmann-form law: its multiplier folded into A (A / (k N)^alpha = A k^-alpha / N^alpha)."""
        return Fit(self.E, self.A * self.multipliers[arch] ** -self.alpha, self.B, self.alpha, self.beta,
                   self.rmse_log, self.points, self.unique_tokens, self.repeat_decay)

    def loss(self, arch: str, n: float, d: float) -> float:
        return self.for_arch(arch).loss(n, d)


@record
class Observation:
    """A point of the sweep as the fit sees it: its arch, N, D and the final loss of each seed trained there."""

    arch: str
    params: float
    tokens: float
    losses: tuple[float, ...]

    @property
    def loss(self) -> float:
        return float(np.mean(self.losses))


def _joint_arrays(obs: list[Observation], archs: tuple[str, ...]) -> tuple[np.ndarray, ...]:
    for arch in archs:
        have = sum(o.arch == arch for o in obs)
        if have < MIN_POINTS_PER_ARCH:
            raise AdaptiveError(f"{arch}: {have} points trained; a multiplier needs at least {MIN_POINTS_PER_ARCH}")
    if len(obs) < MIN_POINTS + len(archs) - 1:
        raise AdaptiveError(f"a joint law of {len(archs)} archs has {MIN_POINTS + len(archs) - 1} coefficients and "
                            f"needs as many points, got {len(obs)}")
    x, y, log_loss = _arrays([o.params for o in obs], [o.tokens for o in obs], [o.loss for o in obs])
    group = np.array([archs.index(o.arch) for o in obs], dtype=int)
    return x, y, log_loss, group


def _as_joint(theta: np.ndarray, archs: tuple[str, ...], x: np.ndarray, y: np.ndarray, log_loss: np.ndarray,
              group: np.ndarray, unique: float | None) -> JointFit:
    decay = math.exp(float(theta[-1])) if unique is not None else None
    coefficients, ks = _coefficients(theta[:-1] if unique is not None else theta)
    fit = JointFit(*coefficients, multipliers=dict(zip(archs, (1.0, *ks))), reference=archs[0], rmse_log=0.0,
                   points=len(x), unique_tokens=unique, repeat_decay=decay)
    predicted = [fit.loss(archs[g], math.exp(n), math.exp(d)) for n, d, g in zip(x, y, group)]
    return JointFit(**{**fit.__dict__, "rmse_log": float(np.sqrt(np.mean((np.log(predicted) - log_loss) ** 2)))})


def _repeats(obs: list[Observation], unique_tokens: float | None) -> float | None:
    """U when some point trained REPEAT_FIT_EPOCHS of it or more (R_D* is then fitted), else None (D is D)."""
    if unique_tokens is None or max(o.tokens for o in obs) < REPEAT_FIT_EPOCHS * unique_tokens:
        return None
    return unique_tokens


def _theta(fit: Fit | JointFit, multipliers: tuple[float, ...] = ()) -> np.ndarray:
    e, a, b, alpha, beta = fit.coefficients
    decay = [math.log(fit.repeat_decay)] if fit.repeat_decay is not None else []
    return np.array([math.log(a), math.log(b), math.log(e), alpha, beta, *(math.log(k) for k in multipliers), *decay])


def fit_joint(obs: list[Observation], archs: tuple[str, ...], unique_tokens: float | None = None) -> JointFit:
    """The joint law over `obs` (the mean of each point's seeds); archs[0] is the reference (multiplier 1).
    `unique_tokens`: the corpus's training tokens; R_D* is fitted when a point trained past them."""
    x, y, log_loss, group = _joint_arrays(obs, archs)
    unique = _repeats(obs, unique_tokens)
    grid = _starts(len(archs) - 1)
    starts = grid if unique is None else [np.append(t, math.log(r)) for r in DECAY_STARTS for t in grid]
    return _as_joint(_best(x, y, log_loss, group, starts, unique), archs, x, y, log_loss, group, unique)


def bootstrap_joint(obs: list[Observation], fit: JointFit, samples: int = 100, seed: int = 0,
                    on_refit: Callable[[int], None] | None = None) -> list[JointFit]:
    """Refits on resamplings: each arch's points drawn with replacement among its own (every arch keeps its
    count), and each point's loss the mean of its seeds drawn with replacement (the seed spread enters the band).
    `on_refit(done)` after each refit."""
    archs = tuple(fit.multipliers)
    x, y, _, group = _joint_arrays(obs, archs)
    unique = fit.unique_tokens if fit.repeat_decay is not None else None
    rng = np.random.default_rng(seed)
    by_arch = [np.flatnonzero(group == i) for i in range(len(archs))]
    grid = _starts(len(archs) - 1)[::54]
    starts = [_theta(fit, tuple(fit.multipliers.values())[1:]),
              *(grid if unique is None else [np.append(t, math.log(DECAY_STARTS[0])) for t in grid])]
    out = []
    while len(out) < samples:
        pick = np.concatenate([rng.choice(idx, len(idx)) for idx in by_arch])
        if any(len(set(pick[group[pick] == i].tolist())) < 2 for i in range(len(archs))):
            continue  # an arch on one distinct point says nothing about its multiplier
        log_loss = np.log([np.mean(rng.choice(obs[i].losses, len(obs[i].losses))) for i in pick])
        theta = _best(x[pick], y[pick], log_loss, group[pick], starts, unique)
        out.append(_as_joint(theta, archs, x[pick], y[pick], log_loss, group[pick], unique))
        if on_refit is not None:
            on_refit(len(out))
    return out


def interval(values: list[float], low: float = 0.05, high: float = 0.95) -> tuple[float, float]:
    """The [low, high] quantiles of `values` (the band the planner shows: 5-95%)."""
    return float(np.quantile(values, low)), float(np.quantile(values, high))


__all__ = ["Fit", "HUBER_DELTA", "JointFit", "N_DEFINITION", "Observation", "bootstrap", "bootstrap_joint",
           "effective_tokens", "fit_joint", "fit_law", "interval", "law_loss"]
