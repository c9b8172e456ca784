"""The orchestrator's decision log: `<output-dir>/events.jsonl`, one JSON object per line.

    kind "decision"   one per action a policy took (or a recommendation it made):
        step        optimizer steps done when it was decided
        time        unix seconds
        policy      "monitor" | "balance" | "capacity" | "oom" | "guard" | "ep"
        action      what it did, e.g. "raise_capacity", "halve_micro_batch", "rollback"
        reason      one line of why
        signals     {name: value} the decision read (MaxVio, dropped fraction, loss, ...)
        before      {knob: value} before the action
        after       {knob: value} after it
    kind "summary"    one at the end of training: step, time, policies (the ones that ran),
                      decisions {policy: {action: count}}, and each policy's own summary under
                      its name.

    kind "fault"      a rank failed (written by the training loop, orchestrator on or off): rank,
                      step, phase, reason, restart (the launcher's restart count), reported_by
    kind "restart"    a restarted worker group took over: restart, step (where it resumed), checkpoint
                      (None: no complete checkpoint yet, started afresh). Neither is ever removed.

    kind "resume"     where a resumed run took over: step (the checkpoint's), time, checkpoint,
                      dropped (how many records of the steps after it were removed)

Every rank makes the same decisions (they read all-reduced signals); only the main process writes.
The file is appended to while a run trains, so a rolled-back run keeps its whole history (the
rollback is a decision). When a run starts, what came after its starting step is removed: a fresh
run in an old folder starts an empty log, and `--resume` keeps the records written before the first
one of a later step (the decisions after the checkpoint will be made again), marks the resume, and
counts the kept decisions in the end summary.

Experiment trackers (`--report-to`): each decision is also logged as the scalar
`orchestrator/<policy>/<action>` = how many times it was taken so far (a resumed run's count goes on
from the kept ones), at its step. The log reaches the trackers through the loop's contract: the
`log(values, step)` hook of `TrainerState`, which `EventSummary` hands to `EventLog.open`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any, Callable

from adaptive.durable import atomic_write_text
from adaptive.orchestrator.contract import Control, TrainerState

logger = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
HISTORY = ("fault", "restart")  # records no resume removes


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf become null, tuples lists, paths strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


RECENT = 1000  # decisions kept in memory (the file has them all); the counts cover every one


class EventLog:
    """Counts decisions (for the summary), keeps the recent ones, appends all to events.jsonl."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.enabled = False
        self.main = True  # this process logs (the main process; every rank decides the same)
        self.decisions: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self._counts: dict[str, Counter] = {}
        self._opened = False
        self._pending: list[dict[str, Any]] = []
        self._log: Callable[[dict[str, float], int], None] | None = None  # the trackers (TrainerState.log)
        self._pending_log: list[tuple[dict[str, float], int]] = []

    def open(self, output_dir: Path | None, enabled: bool, start_step: int | None = None,
             resumed_from: Path | None = None, log: Callable[[dict[str, float], int], None] | None = None) -> None:
        """Where to write (None or disabled: keep decisions in memory only). With `start_step`, the
        file's records of later steps are removed first (see the module docstring). `log(values, step)`:
        where the decision counts go for the experiment trackers (main process only)."""
        self.path = Path(output_dir) / EVENTS_FILE if output_dir is not None else None
        self.main = enabled
        self.enabled = enabled and self.path is not None
        self._opened = True
        if self.enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if start_step is not None:
                self._trim_after(start_step, resumed_from)
        pending, self._pending = self._pending, []
        for record in pending:
            self._write(record)
        self._log = log if self.main else None
        pending_log, self._pending_log = self._pending_log, []
        for values, step in pending_log:
            self._track(values, step)

    def record(self, step: int, policy: str, action: str, reason: str, signals: dict[str, Any] | None = None,
               before: dict[str, Any] | None = None, after: dict[str, Any] | None = None) -> dict[str, Any]:
        event = _clean({"kind": "decision", "step": step, "time": time.time(), "policy": policy, "action": action,
                        "reason": reason, "signals": signals or {}, "before": before or {}, "after": after or {}})
        self.decisions.append(event)
        self._counts.setdefault(policy, Counter())[action] += 1
        self._write(event)
        self._track({f"orchestrator/{policy}/{action}": self._counts[policy][action]}, step)
        if self.main and action != "bias_update":  # the routine balancing update is summarised, not logged per step
            logger.info("orchestrator %s at step %d: %s (%s) %s -> %s", policy, step, action, reason,
                        event["before"], event["after"])
        return event

    def _trim_after(self, step: int, resumed_from: Path | None) -> None:
        records = read_events(self.path) if self.path.exists() else []
        kept: list[dict[str, Any]] = []
        if resumed_from is not None:  # the file is in time order: what follows the first later step is
            for r in records:         # the abandoned history, a rollback's decisions at earlier steps too
                if r.get("step", 0) > step:
                    break
                kept.append(r)
        # a failure and the restart after it happened, whatever the run redoes (adaptive.train.run.faults)
        kept += [r for r in records if r.get("kind") in HISTORY and r not in kept]
        for r in kept:  # the end summary counts the whole run's decisions
            if r.get("kind") == "decision":
                self._counts.setdefault(r["policy"], Counter())[r["action"]] += 1
        if resumed_from is not None:
            kept.append({"kind": "resume", "step": step, "time": time.time(), "checkpoint": str(resumed_from),
                         "dropped": len(records) - len(kept)})
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def _track(self, values: dict[str, float], step: int) -> None:
        if not self._opened:
            self._pending_log.append((values, step))
        elif self._log is not None:
            self._log(values, step)

    def counts(self) -> dict[str, dict[str, int]]:
        return {p: dict(c) for p, c in self._counts.items()}

    def write_summary(self, step: int, policies: list[str], details: dict[str, Any]) -> dict[str, Any]:
        summary = _clean({"kind": "summary", "step": step, "time": time.time(), "policies": policies,
                          "decisions": self.counts(), **details})
        self._write(summary)
        if self.main and summary.get("decisions"):  # a run it never acted on says nothing
            logger.info("orchestrator summary: %s", json.dumps(summary["decisions"]))
        return summary

    def _write(self, record: dict[str, Any]) -> None:
        if not self._opened:  # decided before the log knew its folder
            self._pending.append(record)
            return
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


class EventSummary:
    """The orchestrator's last callback: opens the log at the start, writes the summary at the end."""

    name = "summary"

    def __init__(self, events: EventLog, policies: list[Any]) -> None:
        self.events = events
        self.policies = policies

    def on_train_start(self, state: TrainerState, control: Control) -> None:
        self.events.open(state.output_dir, state.is_main_process, state.step, state.resumed_from,
                         log=getattr(state, "log", None))

    def on_train_end(self, state: TrainerState, control: Control) -> None:
        details = {p.name: p.summary() for p in self.policies if hasattr(p, "summary")}
        self.events.write_summary(state.step, [p.name for p in self.policies], details)


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The records of an events.jsonl (lines cut short by a crash are skipped)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


__all__ = ["EVENTS_FILE", "EventLog", "EventSummary", "read_events"]
