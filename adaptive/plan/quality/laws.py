"""Scaling laws as data: each one's form, coefficients, source, what it counts as N and where it was fitted.

Dense laws have Hoffmann et al.'s parametric form L(N, D) = E + A / N^alpha + B / D^beta (loss in nats per
token on the data the law was fitted on). The MoE law is Ludziejewski et al. 2025's joint law in active
parameters, tokens and expert count. The formulas are checked against figures printed in the papers
(tests/plan/quality/test_laws.py).
"""

from __future__ import annotations

import math

from adaptive.record import record

N_TOTAL = "total"  # every parameter, embeddings included (Chinchilla)
N_ACTIVE = "active"  # the parameters one token uses, embeddings included (MoE: top-k experts)
N_ACTIVE_NON_EMBEDDING = "active_non_embedding"
N_DEFINITIONS = (N_TOTAL, N_ACTIVE, N_ACTIVE_NON_EMBEDDING)


@record
class DenseLaw:
    """L(N, D) = E + A / N^alpha + B / D^beta."""

    name: str
    E: float
    A: float
    B: float
    alpha: float
    beta: float
    source: str  # the citation
    fitted_on: str  # the data (and tokenizer) the loss is measured on
    n_definition: str = N_TOTAL
    params_range: tuple[float, float] = (0.0, math.inf)  # N the fit saw
    tokens_range: tuple[float, float] = (0.0, math.inf)  # D the fit saw
    repeat_decay: float | None = None  # R_D* fitted with the law (a law.json); None: Muennighoff et al.'s

    def loss(self, n: float, d: float) -> float:
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    def optimal_split(self, flops: float) -> tuple[float, float]:
        """(N, D) minimising the loss at C = 6 N D (Hoffmann et al. 2022, eq. 4)."""
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))
        a = self.beta / (self.alpha + self.beta)
        n = g * (flops / 6.0) ** a
        return n, flops / (6.0 * n)


MASSIVETEXT = "MassiveText (DeepMind), SentencePiece 32k tokenizer; loss in nats per token"

# Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models", approach 3 (section 3.3, appendix D.2),
# fitted on 400+ runs from 70M to 16B parameters and 5B to 500B tokens, with every parameter (embeddings
# included) counted. The paper prints the fit rounded (E 1.69, A 406.4, B 410.7, alpha 0.34, beta 0.28); these
# are the unrounded values of its TeX source (Besiroglu et al. 2024), which reproduce the paper's own figures
# (a = 0.46 in its Table 2, 40B parameters at Gopher's budget in figure 4); the rounded ones do not (0.45, 32B).
CHINCHILLA = DenseLaw(
    name="chinchilla", E=math.exp(0.5267228), A=math.exp(6.0073404), B=math.exp(6.0179186),
    alpha=0.33917084, beta=0.2849083,
    source="Hoffmann et al. 2022 (Chinchilla), approach 3, arXiv 2203.15556",
    fitted_on=MASSIVETEXT, n_definition=N_TOTAL, params_range=(7e7, 1.6e10), tokens_range=(5e9, 5e11))

# Besiroglu et al. 2024, "Chinchilla Scaling: A replication attempt": the same runs, read back from the
# paper's figure 4 and refitted (their Huber fit). Its optimum agrees with Chinchilla's approaches 1 and 2
# (~20 tokens per parameter); the original approach-3 fit does not (~70), and its intervals are implausibly
# narrow.
EPOCH = DenseLaw(
    name="epoch", E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658,
    source="Besiroglu et al. 2024 (Epoch AI), refit of Chinchilla's runs, arXiv 2404.10102",
    fitted_on=MASSIVETEXT, n_definition=N_TOTAL, params_range=(7e7, 1.6e10), tokens_range=(5e9, 5e11))

DENSE_LAWS = {law.name: law for law in (CHINCHILLA, EPOCH)}
DEFAULT_LAW = "epoch"  # docs/DESIGN.md, "Quality": why the refit and not the original


@record
class JointMoELaw:
    """L(N_act, D, Ê) = a Ê^delta N_act^(alpha + gamma ln Ê) + b Ê^omega D^(beta + zeta ln Ê) + c (the exponents
    negative), with the expert count E transformed to Ê: 1/Ê = 1/(E - 1 + (1/E_start - 1/E_max)^-1) + 1/E_max,
    which is E_start for a dense model (E = 1) and saturates at E_max."""

    name: str
    a: float
    alpha: float
    b: float
    beta: float
    c: float
    gamma: float
    delta: float
    omega: float
    zeta: float
    e_start: float
    e_max: float
    source: str
    fitted_on: str
    routing: str  # how their experts are routed (our top-k maps onto it: predict.py)
    n_definition: str = N_ACTIVE
    experts_range: tuple[float, float] = (1.0, 32.0)
    params_range: tuple[float, float] = (0.0, math.inf)
    tokens_range: tuple[float, float] = (0.0, math.inf)

    def transformed_experts(self, experts: float) -> float:
        shift = 1.0 / (1.0 / self.e_start - 1.0 / self.e_max)
        return 1.0 / (1.0 / (experts - 1.0 + shift) + 1.0 / self.e_max)

    def reduced(self, experts: float) -> tuple[float, float, float, float]:
        """(m, mu, n, nu) of the law at a fixed E: L = m N^mu + n D^nu + c (their Table 4)."""
        e = self.transformed_experts(experts)
        ln_e = math.log(e)
        return (self.a * e**self.delta, self.alpha + self.gamma * ln_e,
                self.b * e**self.omega, self.beta + self.zeta * ln_e)

    def loss(self, n_active: float, d: float, experts: float) -> float:
        m, mu, n, nu = self.reduced(experts)
        return m * n_active**mu + n * d**nu + self.c

    def optimal_split(self, flops: float, experts: float) -> tuple[float, float]:
        """(N_act, D) minimising the loss at C = 6 N_act D."""
        m, mu, n, nu = self.reduced(experts)
        # d/dN [m N^mu + n (C/6)^nu N^-nu] = 0  ->  N^(mu + nu) = (n nu / (m mu)) (C/6)^nu
        big_n = ((n * nu) / (m * mu) * (flops / 6.0) ** nu) ** (1.0 / (mu + nu))
        return big_n, flops / (6.0 * big_n)


# Ludziejewski et al. 2025, "Joint MoE Scaling Laws: Mixture of Experts Can Be Memory Efficient" (ICML), Table 3:
# 280+ runs on FineWeb-Edu (GPT-2 tokenizer), E in 1..32 experts routed top-1 (Switch), 79M to 2.7B active
# parameters (embeddings included), 0.5B to 80B tokens; held-out RMSE 0.0039.
JOINT_MOE = JointMoELaw(
    name="ludziejewski2025", a=35.91, alpha=-0.1889, b=35.98, beta=-0.1775, c=1.3637, gamma=0.0098, delta=-0.2285,
    omega=0.5529, zeta=-0.0259, e_start=2.0732, e_max=290.4521,
    source="Ludziejewski et al. 2025 (joint MoE scaling law), arXiv 2502.05172, Table 3",
    fitted_on="FineWeb-Edu, GPT-2 tokenizer (50,257)", routing="top-1 (Switch), experts as wide as the dense FFN",
    n_definition=N_ACTIVE, experts_range=(1.0, 32.0), params_range=(7.9e7, 2.7e9), tokens_range=(5e8, 8e10))

# Raposo et al. 2024, "Mixture-of-Depths" (arXiv 2404.02258), report isoFLOP comparisons, not a law: "These models
# match baseline performance for equivalent FLOPS and wall-clock times to train" (abstract), and improve on the
# isoFLOP-optimal baseline "by up to 1.5%" at their best setting (capacity 12.5%, every other block). We state
# the effect on compute: a MoD model trained on D tokens reaches the loss its dense twin reaches on the tokens
# the same FLOPs buy, (MoD FLOPs / dense FLOPs) x D; the 1.5% is the band's optimistic edge.
MOD_EFFECT_SOURCE = ("Raposo et al. 2024 (Mixture-of-Depths), arXiv 2404.02258: isoFLOP parity with the dense "
                     "baseline (a stated effect on compute, not a fitted law)")
MOD_BEST_GAIN = 0.015  # "up to 1.5%" lower loss at equal FLOPs, at their best capacity and routing
