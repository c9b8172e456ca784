"""Read a run's JSON-lines files for `adaptive report`, keeping only records of the shape it draws.

A run folder is written by a process that may have crashed mid-line, been copied through a tool that
mangled bytes, or been edited by hand. Each line must decode as UTF-8, parse as a JSON object, and
(for the kinds the report reads) carry fields of the right types, checked by pydantic: an integer
step, numbers or null for the curves, lists of numbers for per-layer series. Other lines are skipped
and counted, so the report can say how many in one warning line instead of failing on one of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_MODELS: dict[str, type] | None = None


def _models() -> dict[str, type]:
    """kind -> the pydantic model a record of that kind must fit (other kinds: any object)."""
    global _MODELS
    if _MODELS is not None:
        return _MODELS
    from typing import Annotated, Optional

    from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

    number = Optional[StrictFloat | StrictInt]  # NaN and infinity are real values of a loss
    step = Annotated[int, Field(strict=True, ge=0)]

    class Record(BaseModel):
        model_config = ConfigDict(extra="allow")

    class Train(Record):
        step: step
        loss: number = None
        ppl: number = None
        max_vio_max: number = None
        tokens_seen: number = None
        skipped_steps: number = None
        tokens_per_s: number = None
        train_seconds: number = None
        interval_steps: number = None
        mfu: number = None
        peak_rss_bytes: number = None
        memory: Optional[dict[str, number]] = None
        dropped_fraction: Optional[list[StrictFloat | StrictInt]] = None
        mod_skip_rate: Optional[list[StrictFloat | StrictInt]] = None
        expert_counts: Optional[list[list[StrictFloat | StrictInt]]] = None

    class Eval(Record):
        step: step
        eval_loss: number = None

    class End(Record):
        wall_seconds: number = None
        train_seconds_total: number = None
        tokens_per_s: number = None
        mfu: number = None
        peak_memory_bytes: number = None
        launches: number = None

    class Decision(Record):
        step: step
        policy: StrictStr
        action: StrictStr

    class Start(Record):
        preset: Optional[StrictStr] = None
        arch: Optional[StrictStr] = None
        orchestrator: Optional[dict[str, Any]] = None

    class Summary(Record):
        ep: Optional[dict[str, Any]] = None

    count = Annotated[int, Field(strict=True, ge=0)]

    class Fault(Record):
        rank: count
        step: Optional[count] = None

    class Restart(Record):
        step: step
        restart: count

    _MODELS = {"train": Train, "eval": Eval, "end": End, "decision": Decision, "start": Start, "summary": Summary,
               "fault": Fault, "restart": Restart}
    return _MODELS


def read_records(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """(the records that fit their kind's shape, how many non-blank lines were skipped)."""
    from pydantic import ValidationError

    models = _models()
    out: list[dict[str, Any]] = []
    skipped = 0
    for raw in Path(path).read_bytes().splitlines():
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
            if not isinstance(record, dict):
                raise ValueError("not an object")
            if record.get("kind") in models:
                models[record["kind"]].model_validate(record)
        except (UnicodeDecodeError, ValueError, ValidationError):  # JSONDecodeError is a ValueError
            skipped += 1
            continue
        out.append(record)
    return out, skipped


__all__ = ["read_records"]
