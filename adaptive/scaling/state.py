"""sweep.json: the sweep's settings and each point's outcome, rewritten atomically after every point.

    {"format": "adaptive-sweep", "version": 1, "settings": {...grid.SweepSettings...},
     "points": {"dense-c1e+12-w64": {"arch": ..., "budget": ..., "width": ..., "params": ..., "tokens": ...,
                                     "status": "done", "eval_loss": 4.1, "seconds": 12.5}, ...}}

A point is "pending" (not finished: a rerun trains it, resuming its checkpoint), "done" (its final eval loss),
or "diverged" (NaN/inf: excluded from the fit, with the reason). A rerun with other settings into the same
folder is refused, so one sweep.json never mixes two sweeps.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from adaptive.durable import atomic_write_text
from adaptive.errors import AdaptiveError
from adaptive.scaling.grid import Point, SweepSettings

FORMAT = "adaptive-sweep"
VERSION = 1
SWEEP_FILE = "sweep.json"
PENDING, DONE, DIVERGED = "pending", "done", "diverged"


def load(out: Path) -> dict[str, Any] | None:
    """The sweep in `out`, or None when there is none yet; AdaptiveError when the file is not a sweep."""
    path = Path(out) / SWEEP_FILE
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise AdaptiveError(f"{path}: not a readable sweep file ({err}); move it away or use another --out") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("points"), dict):
        raise AdaptiveError(f"{path} is not a sweep that `adaptive scale` wrote; use another --out")
    return raw


def start(out: Path, settings: SweepSettings, points: list[Point]) -> dict[str, Any]:
    """The sweep in `out` (continued) or a new one; refused when `out` holds a sweep with other settings."""
    old = load(out)
    if old is not None:
        theirs = SweepSettings.from_dict(old["settings"])
        if theirs != settings:
            were = {k: old["settings"].get(k) for k, v in settings.as_dict().items() if old["settings"].get(k) != v}
            shown = ", ".join(f"{k} {v}" for k, v in were.items())
            raise AdaptiveError(f"{Path(out) / SWEEP_FILE} holds a sweep with other settings ({shown}); rerun it "
                                "with those, or give another --out")
        for p in points:  # a grid that gained points (another adaptive version): they are pending
            old["points"].setdefault(p.name, _entry(p))
        return old
    sweep = {"format": FORMAT, "version": VERSION, "settings": settings.as_dict(),
             "points": {p.name: _entry(p) for p in points}}
    Path(out).mkdir(parents=True, exist_ok=True)
    save(out, sweep)
    return sweep


def _entry(point: Point) -> dict[str, Any]:
    return {"name": point.name, **dataclasses.asdict(point), "status": PENDING}


def save(out: Path, sweep: dict[str, Any]) -> None:
    atomic_write_text(Path(out) / SWEEP_FILE, json.dumps(sweep, indent=1, allow_nan=True) + "\n")


def finish(sweep: dict[str, Any], name: str, eval_loss: float, seconds: float, reason: str | None = None) -> None:
    """Record a point's outcome: done with a finite loss, else diverged (with why)."""
    entry = sweep["points"][name]
    entry["eval_loss"] = eval_loss
    entry["seconds"] = round(seconds, 2)
    if math.isfinite(eval_loss) and reason is None:
        entry["status"] = DONE
        entry.pop("reason", None)
    else:
        entry["status"] = DIVERGED
        entry["reason"] = reason or f"final eval loss is {eval_loss}"


def results(sweep: dict[str, Any], status: str = DONE) -> list[dict[str, Any]]:
    return [p for p in sweep["points"].values() if p["status"] == status]


__all__ = ["DIVERGED", "DONE", "PENDING", "SWEEP_FILE", "finish", "load", "results", "save", "start"]
