"""law.json: scaling laws fitted on the user's own data (`adaptive scale` writes it, `fit --loss-law FILE`
reads it). One Hoffmann-form law per architecture, with the range it was fitted on and its bootstrap
refits (the band). Checked by pydantic before use: a missing or non-finite field is one line naming it.

    {"format": "adaptive-loss-law", "version": 1, "name": ..., "source": ..., "fitted_on": ...,
     "laws": {"dense": {"E": ..., "A": ..., "B": ..., "alpha": ..., "beta": ..., "n_definition": "active",
                        "params_range": [lo, hi], "tokens_range": [lo, hi], "points": 9,
                        "rmse_log": 0.004, "bootstrap": [[E, A, B, alpha, beta], ...]},
              "moe": {...}}}
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from adaptive.errors import AdaptiveError, from_validation
from adaptive.plan.quality.laws import N_ACTIVE, N_DEFINITIONS, DenseLaw
from adaptive.record import record

FORMAT = "adaptive-loss-law"
VERSION = 1
ARCH_KEYS = ("dense", "moe", "mod", "hybrid")


@record
class FittedLaws:
    """A law.json: per arch, the fitted law and its bootstrap refits."""

    path: str
    name: str
    source: str
    fitted_on: str
    laws: dict[str, DenseLaw]
    bootstrap: dict[str, tuple[DenseLaw, ...]]
    rmse_log: dict[str, float]

    def __hash__(self) -> int:
        return hash(self.path)


def _schema() -> type:
    from typing import Annotated, Literal

    from pydantic import BaseModel, ConfigDict, Field, StrictStr, model_validator

    finite = Annotated[float, Field(allow_inf_nan=False)]
    positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]

    class Law(BaseModel):
        model_config = ConfigDict(extra="forbid")
        E: Annotated[float, Field(ge=0, allow_inf_nan=False)]
        A: positive
        B: positive
        alpha: positive
        beta: positive
        n_definition: Literal[N_DEFINITIONS] = N_ACTIVE  # type: ignore[valid-type]
        params_range: tuple[positive, positive]
        tokens_range: tuple[positive, positive]
        points: Annotated[int, Field(ge=1)] = 1
        rmse_log: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0
        bootstrap: list[tuple[finite, finite, finite, finite, finite]] = []

        @model_validator(mode="after")
        def _ranges(self) -> Any:
            for name in ("params_range", "tokens_range"):
                lo, hi = getattr(self, name)
                if lo > hi:
                    raise ValueError(f"{name} runs from {lo:g} down to {hi:g}")
            return self

    class File(BaseModel):
        model_config = ConfigDict(extra="allow")
        format: Literal[FORMAT]  # type: ignore[valid-type]
        version: Literal[VERSION]  # type: ignore[valid-type]
        name: StrictStr
        source: StrictStr
        fitted_on: StrictStr
        laws: dict[Literal[ARCH_KEYS], Law] = Field(min_length=1)  # type: ignore[valid-type]

    return File


def _law(arch: str, name: str, source: str, fitted_on: str, coeffs: tuple[float, ...], fields: Any) -> DenseLaw:
    e, a, b, alpha, beta = coeffs
    return DenseLaw(name=f"{name}:{arch}", E=e, A=a, B=b, alpha=alpha, beta=beta, source=source, fitted_on=fitted_on,
                    n_definition=fields.n_definition, params_range=tuple(fields.params_range),
                    tokens_range=tuple(fields.tokens_range))


def load(path: str | Path) -> FittedLaws:
    """The laws in `path`; AdaptiveError (one line) when it is missing, not JSON or malformed."""
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
    try:
        f = _schema().model_validate(raw)
    except ValidationError as err:
        raise from_validation(where, err) from None
    laws, boot, rmse = {}, {}, {}
    for arch, fields in f.laws.items():
        coeffs = (fields.E, fields.A, fields.B, fields.alpha, fields.beta)
        laws[arch] = _law(arch, f.name, f.source, f.fitted_on, coeffs, fields)
        boot[arch] = tuple(_law(arch, f.name, f.source, f.fitted_on, tuple(c), fields) for c in fields.bootstrap
                           if all(math.isfinite(x) for x in c) and min(c[1:]) > 0)
        rmse[arch] = fields.rmse_log
    return FittedLaws(path=str(path), name=f.name, source=f.source, fitted_on=f.fitted_on, laws=laws,
                      bootstrap=boot, rmse_log=rmse)


def law_dict(law: DenseLaw, points: int, rmse_log: float, bootstrap: list[tuple[float, ...]]) -> dict:
    """One arch's entry of law.json (what `adaptive scale` writes)."""
    return {"E": law.E, "A": law.A, "B": law.B, "alpha": law.alpha, "beta": law.beta,
            "n_definition": law.n_definition, "params_range": list(law.params_range),
            "tokens_range": list(law.tokens_range), "points": points, "rmse_log": rmse_log,
            "bootstrap": [list(c) for c in bootstrap]}


def file_dict(name: str, source: str, fitted_on: str, laws: dict[str, dict]) -> dict:
    return {"format": FORMAT, "version": VERSION, "name": name, "source": source, "fitted_on": fitted_on,
            "laws": laws}
