"""law.json: the scaling law fitted on the user's own data (`adaptive scale` writes it, `fit --loss-law FILE`
reads it). One Hoffmann-form law across architectures, with shared E, A, B, alpha, beta and a multiplier per arch
on its effective parameters (scaling/fit_law.JointFit), the range each arch was fitted on, and the bootstrap
refits (the band; refit i of every arch is one refit, so two archs' predictions pair up). Checked by pydantic
before use: a missing or non-finite field is one line naming it.

    {"format": "adaptive-loss-law", "version": 2, "name": ..., "source": ..., "fitted_on": ...,
     "reference": "dense",
     "law": {"E": ..., "A": ..., "B": ..., "alpha": ..., "beta": ..., "n_definition": "active", "points": 36,
             "rmse_log": 0.004, "unique_tokens": 1.2e5, "repeat_decay": 2.3},
     "archs": {"dense": {"multiplier": 1.0, "params_range": [lo, hi], "tokens_range": [lo, hi], "points": 9,
                         "seeds": 1, "seed_spread": 0.0}, "moe": {...}},
     "bootstrap": [{"E": ..., "A": ..., "B": ..., "alpha": ..., "beta": ..., "multipliers": {"dense": 1.0, ...}}]}

Version 1 held a separate law per arch; those rank archs wrongly on a small sweep, and are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adaptive.errors import AdaptiveError, from_validation
from adaptive.plan.quality.laws import N_ACTIVE, N_DEFINITIONS, DenseLaw
from adaptive.record import record

FORMAT = "adaptive-loss-law"
VERSION = 2
ARCH_KEYS = ("dense", "moe", "mod", "hybrid")


@record
class FittedLaws:
    """A law.json: per arch, its law (the multiplier folded into A) and its bootstrap refits, paired by index."""

    path: str
    name: str
    source: str
    fitted_on: str
    reference: str  # the arch whose multiplier is 1
    laws: dict[str, DenseLaw]
    bootstrap: dict[str, tuple[DenseLaw, ...]]  # refit i of every arch comes from one refit
    multipliers: dict[str, float]
    multiplier_refits: dict[str, tuple[float, ...]]
    rmse_log: float

    def __hash__(self) -> int:
        return hash(self.path)


def _schema() -> type:
    from typing import Annotated, Literal

    from pydantic import BaseModel, ConfigDict, Field, StrictStr, model_validator

    positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
    arch_key = Literal[ARCH_KEYS]  # type: ignore[valid-type]

    class Shared(BaseModel):
        model_config = ConfigDict(extra="forbid")
        E: Annotated[float, Field(ge=0, allow_inf_nan=False)]
        A: positive
        B: positive
        alpha: positive
        beta: positive

    class Law(Shared):
        n_definition: Literal[N_DEFINITIONS] = N_ACTIVE  # type: ignore[valid-type]
        points: Annotated[int, Field(ge=1)] = 1
        rmse_log: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
        unique_tokens: positive | None = None  # the sweep's corpus, when its points repeated it
        repeat_decay: positive | None = None  # R_D*, fitted on those repeats

    class Arch(BaseModel):
        model_config = ConfigDict(extra="forbid")
        multiplier: positive
        params_range: tuple[positive, positive]
        tokens_range: tuple[positive, positive]
        points: Annotated[int, Field(ge=1)] = 1
        seeds: Annotated[int, Field(ge=1)] = 1
        seed_spread: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0

        @model_validator(mode="after")
        def _ranges(self) -> Any:
            for name in ("params_range", "tokens_range"):
                lo, hi = getattr(self, name)
                if lo > hi:
                    raise ValueError(f"{name} runs from {lo:g} down to {hi:g}")
            return self

    class Refit(Shared):
        multipliers: dict[arch_key, positive]
        repeat_decay: positive | None = None

    class File(BaseModel):
        model_config = ConfigDict(extra="allow")
        format: Literal[FORMAT]  # type: ignore[valid-type]
        version: Literal[VERSION]  # type: ignore[valid-type]
        name: StrictStr
        source: StrictStr
        fitted_on: StrictStr
        reference: arch_key
        law: Law
        archs: dict[arch_key, Arch] = Field(min_length=1)
        bootstrap: list[Refit] = []

        @model_validator(mode="after")
        def _consistent(self) -> Any:
            if self.reference not in self.archs:
                raise ValueError(f"reference {self.reference!r} is not one of archs ({', '.join(self.archs)})")
            for i, refit in enumerate(self.bootstrap):
                if set(refit.multipliers) != set(self.archs):
                    raise ValueError(f"bootstrap[{i}] has multipliers for {', '.join(refit.multipliers)}, "
                                     f"archs are {', '.join(self.archs)}")
            return self

    return File


def _law(arch: str, f: Any, shared: Any, multiplier: float) -> DenseLaw:
    """The arch's own Hoffmann-form law: A / (k N)^alpha = (A k^-alpha) / N^alpha."""
    a = f.archs[arch]
    return DenseLaw(name=f"{f.name}:{arch}", E=shared.E, A=shared.A * multiplier ** -shared.alpha, B=shared.B,
                    alpha=shared.alpha, beta=shared.beta, source=f.source, fitted_on=f.fitted_on,
                    n_definition=f.law.n_definition, params_range=tuple(a.params_range),
                    tokens_range=tuple(a.tokens_range), repeat_decay=shared.repeat_decay)


def load(path: str | Path) -> FittedLaws:
    """The laws in `path`; AdaptiveError (one line) when it is missing, not JSON, malformed or of version 1."""
    import json  # only where a law file is read: a published law needs none

    from pydantic import ValidationError

    where = f"--loss-law {str(path)!r}"
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise AdaptiveError(f"{where}: no such file; give chinchilla, epoch or a law.json that `adaptive scale` "
                            "wrote") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdaptiveError(f"{where}: not a readable JSON file: {e}") from None
    if not isinstance(raw, dict):
        raise AdaptiveError(f"{where}: must hold a JSON object, got {type(raw).__name__}")
    if raw.get("format") == FORMAT and raw.get("version") == 1:
        raise AdaptiveError(f"{where} is a version-1 file of separate per-arch laws, which cannot rank archs; "
                            "refit it as one joint law: rerun `adaptive scale` with the same --out (no point "
                            "trains again)")
    try:
        f = _schema().model_validate(raw)
    except ValidationError as err:
        raise from_validation(where, err) from None
    multipliers = {arch: a.multiplier for arch, a in f.archs.items()}
    laws = {arch: _law(arch, f, f.law, k) for arch, k in multipliers.items()}
    boot = {arch: tuple(_law(arch, f, r, r.multipliers[arch]) for r in f.bootstrap) for arch in f.archs}
    refits = {arch: tuple(r.multipliers[arch] for r in f.bootstrap) for arch in f.archs}
    return FittedLaws(path=str(path), name=f.name, source=f.source, fitted_on=f.fitted_on, reference=f.reference,
                      laws=laws, bootstrap=boot, multipliers=multipliers, multiplier_refits=refits,
                      rmse_log=f.law.rmse_log)


def file_dict(name: str, source: str, fitted_on: str, reference: str, law: dict, archs: dict[str, dict],
              bootstrap: list[dict]) -> dict:
    """law.json's content (what `adaptive scale` writes)."""
    return {"format": FORMAT, "version": VERSION, "name": name, "source": source, "fitted_on": fitted_on,
            "reference": reference, "law": law, "archs": archs, "bootstrap": bootstrap}


def law_dict(coefficients: tuple[float, ...], n_definition: str, points: int, rmse_log: float,
             unique_tokens: float | None = None, repeat_decay: float | None = None) -> dict:
    e, a, b, alpha, beta = coefficients
    return {"E": e, "A": a, "B": b, "alpha": alpha, "beta": beta, "n_definition": n_definition, "points": points,
            "rmse_log": rmse_log, "unique_tokens": unique_tokens, "repeat_decay": repeat_decay}


def arch_dict(multiplier: float, params_range: tuple[float, float], tokens_range: tuple[float, float], points: int,
              seeds: int = 1, seed_spread: float = 0.0) -> dict:
    return {"multiplier": multiplier, "params_range": list(params_range), "tokens_range": list(tokens_range),
            "points": points, "seeds": seeds, "seed_spread": seed_spread}


def refit_dict(coefficients: tuple[float, ...], multipliers: dict[str, float], repeat_decay: float | None = None) -> dict:
    e, a, b, alpha, beta = coefficients
    return {"E": e, "A": a, "B": b, "alpha": alpha, "beta": beta, "multipliers": multipliers,
            "repeat_decay": repeat_decay}
