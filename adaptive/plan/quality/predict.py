"""The loss a run should reach: a law (published, or fitted on your data) at the run's parameters and tokens,
with the stated effects of MoE, MoD and repeated data, and a band.

- Dense: the chosen Hoffmann-form law (`--loss-law`: chinchilla, epoch, or a law.json), at N as the law counts
  it. For an MoE the dense law is taken at the active parameters.
- MoE: Ludziejewski et al. 2025's joint law gives the MoE's reducible loss relative to a dense model with the
  same active parameters and tokens; that ratio multiplies the dense law's reducible loss (the MoE law was fitted
  on other data, so its ratio travels, its absolute loss does not). Our top-k of E experts counts as E/k
  experts (their experts are routed top-1); counting all E is the band's optimistic edge.
- MoD: isoFLOP parity (laws.MOD_EFFECT_SOURCE): the loss of the dense twin on the tokens the same FLOPs buy.
- Hybrid: both, an extrapolation no paper measured.
- Repeated data (a known dataset size): Muennighoff et al. 2023's effective tokens and parameters.
- The band: the two published fits of the same runs (Hoffmann; Besiroglu), the effects' own ranges, +-1% for
  the fit's residual, doubled outside the law's fitted range. A law.json's band is its bootstrap's 5-95%.
- A law.json (`adaptive scale`) is one law across archs, each arch's N counted times its multiplier; an arch it
  was not fitted on is its reference arch with the published effects.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from adaptive.errors import AdaptiveError, closest
from adaptive.plan.architecture.blocks import block_type
from adaptive.plan.architecture.params import ParamCounts
from adaptive.plan.architecture.presets import ModelSpec
from adaptive.plan.estimate.throughput import model_flops_per_token
from adaptive.plan.quality import repeated_data
from adaptive.plan.quality.law_file import FittedLaws
from adaptive.plan.quality.laws import (DEFAULT_LAW, DENSE_LAWS, JOINT_MOE, MOD_BEST_GAIN, MOD_EFFECT_SOURCE,
                                        N_ACTIVE, N_ACTIVE_NON_EMBEDDING, N_TOTAL, DenseLaw)
from adaptive.record import record

RESIDUAL = 0.01  # +-1% of the loss: a Hoffmann-form fit's residual on its own runs
EXTRAPOLATION_WIDENING = 2.0  # the band's half-width outside the fitted range


@record
class LossModel:
    """What `--loss-law` names: a published dense law, or a law.json fitted on the user's data."""

    name: str
    dense: DenseLaw
    fitted: FittedLaws | None = None


@record
class Quality:
    predicted_loss: float
    band: tuple[float, float]
    law: str  # what produced it, e.g. "epoch + ludziejewski2025 (MoE)"
    source: str  # the citations
    kind: str  # published law | published laws (MoE) | stated effect (MoD) | extrapolation (hybrid) | fitted on your data
    fitted_on: str  # the data the loss is measured on
    params: float  # N as the law counts it
    n_definition: str
    tokens: float
    effective_tokens: float  # after repeats (and MoD's compute effect)
    unique_tokens: float | None
    notes: tuple[str, ...] = ()
    samples: tuple[float, ...] = ()  # the loss under each bootstrap refit of a fitted law, in refit order (ranking.py)
    refits_of: str = ""  # the law.json the samples' refits come from: two Qualities of one file pair up
    residual: float = 0.0  # that law's rmse of log-loss around its points (ranking.py: the scatter of one run)

    @property
    def perplexity(self) -> float:
        return math.exp(self.predicted_loss)

    @property
    def perplexity_band(self) -> tuple[float, float]:
        return math.exp(self.band[0]), math.exp(self.band[1])


def resolve_law(value: str | None) -> LossModel:
    """`--loss-law`: chinchilla, epoch (default) or a law.json path; AdaptiveError in one line otherwise."""
    value = value or DEFAULT_LAW
    if value.lower() in DENSE_LAWS:
        return LossModel(name=value.lower(), dense=DENSE_LAWS[value.lower()])
    if value.endswith(".json") or Path(value).exists() or "/" in value:
        from adaptive.plan.quality.law_file import load

        fitted = load(value)
        return LossModel(name=fitted.name, dense=fitted.laws[fitted.reference], fitted=fitted)
    near = closest(value, DENSE_LAWS)
    raise AdaptiveError(f"unknown --loss-law {value!r}; " + (f"did you mean {near}?" if near else
                        "give chinchilla, epoch or a law.json that `adaptive scale` wrote"))


def counted_params(counts: ParamCounts, definition: str) -> float:
    if definition == N_ACTIVE:
        return counts.active
    if definition == N_ACTIVE_NON_EMBEDDING:
        return counts.active - counts.embedding
    return counts.total if counts.expert == 0 else counts.active  # a dense law takes an MoE at its active size


def mod_compute_fraction(spec: ModelSpec, seq_len: int) -> float:
    """A MoD model's FLOPs per token over its unrouted twin's (same weights, every block on every token)."""
    if not spec.is_mod:
        return 1.0
    twin = replace(spec, layer_types=tuple("moe" if block_type(t).has_experts else "dense" for t in spec.layer_types),
                   mod_capacity=1.0)
    return model_flops_per_token(spec, seq_len) / model_flops_per_token(twin, seq_len)


def moe_ratio(spec: ModelSpec, n_active: float, tokens: float, experts: float | None = None) -> float:
    """The joint MoE law's reducible loss at `experts` over its dense model's (E = 1), same N_act and D."""
    if not spec.is_moe:
        return 1.0
    e = experts if experts is not None else max(1.0, spec.num_local_experts / max(1, spec.num_experts_per_tok))
    c = JOINT_MOE.c
    return (JOINT_MOE.loss(n_active, tokens, e) - c) / (JOINT_MOE.loss(n_active, tokens, 1.0) - c)


def _dense_loss(law: DenseLaw, counts: ParamCounts, tokens: float, unique: float | None) -> float:
    repeated = unique if unique is not None and tokens > unique else None  # one epoch or less: the law as fitted
    n = repeated_data.effective_params(law, counted_params(counts, law.n_definition), repeated)
    return law.loss(n, repeated_data.effective_tokens(tokens, unique, law.repeat_decay))


def _with_effects(law: DenseLaw, spec: ModelSpec, counts: ParamCounts, tokens: float, unique: float | None,
                  fraction: float, experts: float | None = None) -> float:
    loss = _dense_loss(law, counts, tokens * fraction, unique)
    return law.E + (loss - law.E) * moe_ratio(spec, counts.active, tokens * fraction, experts)


def _range_notes(law: DenseLaw, n: float, d: float) -> list[str]:
    notes = []
    lo, hi = law.params_range
    if not lo <= n <= hi:
        notes.append(f"extrapolated: N = {n:.3g} lies outside the {law.name} fit's {lo:.2g}-{hi:.2g} parameters")
    lo, hi = law.tokens_range
    if not lo <= d <= hi:
        notes.append(f"extrapolated: D = {d:.3g} tokens lies outside the {law.name} fit's {lo:.2g}-{hi:.2g}")
    return notes


def _band(center: float, lo: float, hi: float, extrapolated: bool, residual: float = RESIDUAL) -> tuple[float, float]:
    """[lo, hi] around `center`, widened by the fit's `residual`, its half-widths doubled outside the fitted range."""
    lo, hi = min(lo, center) * (1 - residual), max(hi, center) * (1 + residual)
    if extrapolated:
        lo, hi = center - EXTRAPOLATION_WIDENING * (center - lo), center + EXTRAPOLATION_WIDENING * (hi - center)
    return lo, hi


def predict(spec: ModelSpec, counts: ParamCounts, tokens: float, model: LossModel | None = None,
            unique_tokens: float | None = None, seq_len: int = 2048) -> Quality:
    """The predicted final loss of `spec` trained on `tokens` (of `unique_tokens` unique ones, when known)."""
    model = model or resolve_law(None)
    notes: list[str] = []
    if unique_tokens is not None and tokens > unique_tokens:
        decay = model.dense.repeat_decay
        eff = repeated_data.effective_tokens(tokens, unique_tokens, decay)
        how = f"R_D* {decay:.3g} fitted on your sweep" if decay is not None else "their R_D*"
        notes.append(f"{tokens / unique_tokens:.1f} epochs over {unique_tokens:.3g} unique tokens count as "
                     f"{eff:.3g} fresh ones ({repeated_data.SOURCE}; {how})")
    fitted = model.fitted
    if fitted is not None and spec.arch in fitted.laws:
        return _predict_fitted(fitted, spec, counts, tokens, unique_tokens, notes)
    fraction = mod_compute_fraction(spec, seq_len)
    base = model.dense
    samples: tuple[float, ...] = ()
    center = _with_effects(base, spec, counts, tokens, unique_tokens, fraction)
    edges = [center]
    if fitted is None:  # the other published fit of the same runs
        edges += [_with_effects(law, spec, counts, tokens, unique_tokens, fraction) for law in DENSE_LAWS.values()]
    else:
        samples = tuple(_with_effects(b, spec, counts, tokens, unique_tokens, fraction)
                        for b in fitted.bootstrap.get(fitted.reference, ()))
        edges += list(samples)
        notes.append(f"{fitted.path} was not fitted on {spec.arch!r}: its {fitted.reference} law with the published "
                     f"{'MoE and MoD effects' if spec.arch == 'hybrid' else 'MoE effect' if spec.is_moe else 'MoD effect'}")
    laws, sources, kind = [base.name], [base.source], "published law" if fitted is None else "fitted on your data"
    if spec.is_moe:
        edges.append(_with_effects(base, spec, counts, tokens, unique_tokens, fraction, experts=spec.num_local_experts))
        laws.append(f"{JOINT_MOE.name} (MoE)")
        sources.append(JOINT_MOE.source)
        kind = "published laws (dense + MoE)"
        notes.append(f"MoE: top-{spec.num_experts_per_tok} of {spec.num_local_experts} experts counted as "
                     f"{spec.num_local_experts / spec.num_experts_per_tok:g} top-1 experts (the MoE law's routing)")
        lo, hi = JOINT_MOE.experts_range
        if not lo <= spec.num_local_experts / spec.num_experts_per_tok <= hi:
            notes.append(f"extrapolated: the MoE law was fitted on {lo:g}-{hi:g} experts, this model counts as "
                         f"{spec.num_local_experts / spec.num_experts_per_tok:g}")
        if not JOINT_MOE.params_range[0] <= counts.active <= JOINT_MOE.params_range[1]:
            notes.append(f"extrapolated: the MoE law was fitted on {JOINT_MOE.params_range[0]:.2g}-"
                         f"{JOINT_MOE.params_range[1]:.2g} active parameters, this model has {counts.active:.3g}")
    if spec.is_mod:
        edges += [center * (1 - MOD_BEST_GAIN), center * (1 + MOD_BEST_GAIN)]
        laws.append("MoD isoFLOP parity")
        sources.append(MOD_EFFECT_SOURCE)
        kind = "extrapolation (MoE law x MoD effect)" if spec.is_moe else "stated effect (MoD)"
        notes.append(f"MoD: its FLOPs per token are {fraction:.0%} of its dense twin's; it is predicted as the twin "
                     f"on {fraction:.0%} of the tokens (isoFLOP parity, Raposo et al. 2024)")
    n = counted_params(counts, base.n_definition)
    n_definition = N_ACTIVE if counts.expert and base.n_definition == N_TOTAL else base.n_definition
    notes += _range_notes(base, n, tokens)
    extrapolated = any(note.startswith("extrapolated") for note in notes)
    return Quality(predicted_loss=center, band=_band(center, min(edges), max(edges), extrapolated),
                   law=" + ".join(laws), source="; ".join(sources), kind=kind, fitted_on=base.fitted_on, params=n,
                   n_definition=n_definition, tokens=tokens,
                   effective_tokens=repeated_data.effective_tokens(tokens * fraction, unique_tokens),
                   unique_tokens=unique_tokens, notes=tuple(notes), samples=samples,
                   refits_of=fitted.path if fitted is not None else "",
                   residual=fitted.rmse_log if fitted is not None else 0.0)


def multiplier_note(fitted: FittedLaws, arch: str) -> str:
    """How the joint law counts `arch`: its multiplier over the reference's, with the refits' 5-95%."""
    from adaptive.plan.quality.ranking import interval

    if arch == fitted.reference:
        return f"joint law: {arch} is the reference (multiplier 1); the other archs' N count relative to it"
    k, refits = fitted.multipliers[arch], fitted.multiplier_refits[arch]
    text = (f"joint law: {arch}'s N counts {k:.2f}x {fitted.reference}'s (its effective parameters; at C = 6ND, its "
            "compute multiplier)")
    if not refits:
        return text
    lo, hi = interval(refits)
    verdict = (f"a tie with {fitted.reference}: this data cannot separate them" if lo <= 1.0 <= hi else
               f"separated from {fitted.reference}")
    return f"{text}, {lo:.2f}-{hi:.2f} in 5-95% of {len(refits)} refits: {verdict}"


def _predict_fitted(fitted: FittedLaws, spec: ModelSpec, counts: ParamCounts, tokens: float,
                    unique: float | None, notes: list[str]) -> Quality:
    law = fitted.laws[spec.arch]
    center = _dense_loss(law, counts, tokens, unique)
    samples = tuple(_dense_loss(b, counts, tokens, unique) for b in fitted.bootstrap.get(spec.arch, ()))
    boots = sorted(samples)
    if len(boots) >= 10:
        lo, hi = boots[int(0.05 * (len(boots) - 1))], boots[int(math.ceil(0.95 * (len(boots) - 1)))]
    else:  # no bootstrap: the fit's own residual (log-loss RMSE)
        spread = math.exp(fitted.rmse_log)
        lo, hi = center / spread, center * spread
    n = counted_params(counts, law.n_definition)
    notes.append(multiplier_note(fitted, spec.arch))
    notes += _range_notes(law, n, tokens)
    extrapolated = any(note.startswith("extrapolated") for note in notes)
    return Quality(predicted_loss=center, band=_band(center, lo, hi, extrapolated, residual=0.0), law=law.name,
                   source=fitted.source,
                   kind="fitted on your data", fitted_on=fitted.fitted_on, params=n, n_definition=law.n_definition,
                   tokens=tokens, effective_tokens=repeated_data.effective_tokens(tokens, unique, law.repeat_decay),
                   unique_tokens=unique,
                   notes=tuple(notes), samples=samples, refits_of=fitted.path, residual=fitted.rmse_log)


def quality_dict(q: Quality) -> dict:
    """`quality` in fit's JSON."""
    return {"predicted_loss": q.predicted_loss, "band": list(q.band), "perplexity": q.perplexity,
            "perplexity_band": list(q.perplexity_band), "law": q.law, "source": q.source, "kind": q.kind,
            "fitted_on": q.fitted_on, "params_counted": q.params, "n_definition": q.n_definition,
            "tokens": q.tokens, "effective_tokens": q.effective_tokens, "unique_tokens": q.unique_tokens,
            "epochs": repeated_data.epochs(q.tokens, q.unique_tokens), "notes": list(q.notes)}
