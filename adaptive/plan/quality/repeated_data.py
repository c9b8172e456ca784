"""Repeated data: Muennighoff et al. 2023, "Scaling Data-Constrained Language Models" (arXiv 2305.16264).

Training D tokens on a dataset of U unique tokens repeats it R_D = D/U - 1 times beyond the first epoch, and
the repeats are worth less each time: the effective data is D' = U + U R_D* (1 - exp(-R_D / R_D*)), with
R_D* = 15.4 fitted on their runs (7M to 9B parameters, up to 500 epochs). Parameters beyond what U supports
at the compute optimum (U_N) decay the same way with R_N* = 5.3. "Training with up to 4 epochs of repeated
data yields negligible changes to loss compared to having unique data" (their abstract); past R_D* repeats
stop helping.
"""

from __future__ import annotations

import math

from adaptive.plan.quality.laws import DenseLaw
from adaptive.record import record

SOURCE = "Muennighoff et al. 2023 (data-constrained scaling), arXiv 2305.16264"
R_D_STAR = 15.387756  # the authors' fit (github.com/huggingface/datablations, "Parametric Fit")
R_N_STAR = 5.309743


def _decayed(unique: float, total: float, star: float) -> float:
    repeats = max(total / unique - 1.0, 0.0)
    return unique + unique * star * (1.0 - math.exp(-repeats / star))


def effective_tokens(tokens: float, unique_tokens: float | None, decay: float | None = None) -> float:
    """The fresh-data equivalent of training `tokens` on `unique_tokens` (None: unknown, taken as fresh), repeats
    decaying with `decay` (R_D*; None: the authors')."""
    if unique_tokens is None or tokens <= unique_tokens:
        return tokens
    return _decayed(unique_tokens, tokens, decay or R_D_STAR)


def params_for_data(law: DenseLaw, tokens: float) -> float:
    """U_N: the model size whose compute-optimal token count under `law` is `tokens`."""
    g = (law.alpha * law.A / (law.beta * law.B)) ** (1.0 / (law.alpha + law.beta))
    a = law.beta / (law.alpha + law.beta)
    return (tokens * g ** (1.0 / a)) ** (a / (1.0 - a))


def effective_params(law: DenseLaw, params: float, unique_tokens: float | None) -> float:
    """Parameters beyond U_N (what the unique data supports) count for less, decaying with R_N*."""
    if unique_tokens is None:
        return params
    cap = params_for_data(law, unique_tokens)
    if params <= cap:
        return params
    return _decayed(cap, params, R_N_STAR)


def epochs(tokens: float, unique_tokens: float | None) -> float | None:
    return None if unique_tokens is None else tokens / unique_tokens


@record
class DataConstrainedLaw:
    """Their own fitted law: Hoffmann's form in effective parameters and data (checks the arithmetic above)."""

    law: DenseLaw

    def loss(self, params: float, tokens: float, unique_tokens: float) -> float:
        return self.law.loss(effective_params(self.law, params, unique_tokens),
                             effective_tokens(tokens, unique_tokens))


MUENNIGHOFF = DataConstrainedLaw(DenseLaw(
    name="muennighoff2023", E=math.exp(0.6254804), A=math.exp(6.255414), B=math.exp(7.3049974), alpha=0.3526596,
    beta=0.3526596, source=SOURCE, fitted_on="C4 (GPT-2 tokenizer)", params_range=(7e6, 9e9),
    tokens_range=(1e8, 9e11)))
