"""Where each rank is, and a thread that stops a rank which stopped making progress.

The loop sets `Progress.phase` (data, forward, backward, optimizer, sync, checkpoint, eval, export;
pipeline: DeepSpeed's pipeline schedule, which runs forward, backward and the update)
and `Progress.step` as plain attribute assignments, and calls `step_begins`/`step_done` around each
optimizer step: nothing it does costs more than a clock read.

The `Watchdog` thread, one per rank, wakes every HEARTBEAT_S seconds. It writes this rank's
heartbeat (rank, host, pid, step, phase, time) to RUN/faults/heartbeat-rank<r>.json, which the other
ranks read to name the one that is behind (`adaptive.train.run.faults`), and it checks how long the
current step (or the sync after it) has run:

- not before the first step of this process has finished (compile and warm-up are slow by nature);
- never in a checkpoint, an eval or an export (their length has nothing to do with a step's; a
  checkpoint of a large model takes minutes);
- otherwise it fires after min(hard limit, max(STALL_FACTOR x the median of the recent steps,
  STALL_FLOOR_S)) seconds. The hard limit is --collective-timeout: a step that runs longer than the
  time its peers wait in one collective has already made them give up on it. STALL_FACTOR 10 lets a
  step be ten times its usual length (a garbage collection, a slow data shard) before anything happens;
  STALL_FLOOR_S 60 keeps a run of sub-second steps from stopping on a one-minute hiccup of a shared
  filesystem or the hub.

When it fires, `faults.stop_run` writes the stacks, names the rank, records the event and ends the
process (the elastic agent sees a failure and restarts or stops the run).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import threading
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

HEARTBEAT_S = 1.0
STALL_FACTOR = 10.0
STALL_FLOOR_S = 60.0
RECENT_STEPS = 50
EXEMPT = frozenset({"start", "checkpoint", "eval", "export", "done"})  # phases the watchdog does not time
FAULTS_DIR = "faults"


def heartbeat_file(output_dir: Path, rank: int) -> Path:
    return Path(output_dir) / FAULTS_DIR / f"heartbeat-rank{rank}.json"


class Progress:
    """This rank's step and phase, set by the loop."""

    def __init__(self) -> None:
        self.step = 0  # the optimizer step being run (1-based), or the last one done between steps
        self.phase = "start"
        self.since = time.monotonic()  # when the current step (or the sync after it) began
        self.durations: deque[float] = deque(maxlen=RECENT_STEPS)

    def step_begins(self, step: int) -> None:
        self.step, self.phase, self.since = step, "data", time.monotonic()

    def step_done(self) -> None:
        now = time.monotonic()
        self.durations.append(now - self.since)
        self.phase, self.since = "sync", now

    @contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """A phase the watchdog does not time (a checkpoint, an eval, an export); the one before comes back."""
        before, self.phase = self.phase, phase
        yield  # a failure inside keeps the phase: the fault record names it
        self.phase, self.since = before, time.monotonic()

    def stall_limit(self, hard_limit: float) -> float | None:
        """Seconds the current step may run; None before the first step is done (warm-up)."""
        if not self.durations:
            return None
        return min(hard_limit, max(STALL_FACTOR * statistics.median(self.durations), STALL_FLOOR_S))


class Watchdog(threading.Thread):
    """Heartbeats and the stall check (a daemon thread); `on_stall(seconds)` is called once, from this thread."""

    def __init__(self, progress: Progress, output_dir: Path, rank: int, restart: int, hard_limit: float,
                 on_stall: Callable[[float], Any], interval: float = HEARTBEAT_S) -> None:
        super().__init__(name=f"adaptive-watchdog-rank{rank}", daemon=True)
        self.progress, self.rank, self.restart = progress, rank, restart
        self.file = heartbeat_file(output_dir, rank)
        self.hard_limit, self.on_stall, self.interval = hard_limit, on_stall, interval
        self.finished = threading.Event()
        self.identity = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
                         "start_time": process_start_time(os.getpid()), "restart": restart}

    def run(self) -> None:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        exempt_seen = time.monotonic()
        self.beat()
        while not self.finished.wait(self.interval):
            progress = self.progress
            self.beat()
            now = time.monotonic()
            if progress.phase in EXEMPT:
                exempt_seen = now
                continue
            limit = progress.stall_limit(self.hard_limit)
            waited = now - max(progress.since, exempt_seen)  # a checkpoint's time is not the step's
            if limit is not None and waited > limit:
                self.on_stall(waited)
                return

    def beat(self) -> None:
        """Write the heartbeat (temp file + rename: a reader never sees half of it; no fsync, it is rewritten)."""
        record = {**self.identity, "step": self.progress.step, "phase": self.progress.phase, "time": time.time()}
        tmp = self.file.with_name(f".{self.file.name}.tmp")
        try:
            tmp.write_text(json.dumps(record), encoding="utf-8")
            os.replace(tmp, self.file)
        except OSError:
            pass  # a full disk must not stop training; the checkpoint writer reports it

    def stop(self) -> None:
        self.finished.set()


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the pid, it names
    one process (a pid is reused, the pair is not). None off Linux."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def exit_status(pid: int) -> tuple[str, int | None]:
    """('alive' | 'zombie' | 'gone', the waitpid status of a zombie: /proc/PID/stat field 52) of a local process."""
    fields = _stat_fields(pid)
    if fields is None:
        return "gone", None
    if fields[0] == "Z":
        return "zombie", int(fields[49]) if len(fields) > 49 else None
    return "alive", None


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (after the command name, which may hold spaces)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2:].split()


def read_heartbeats(output_dir: Path) -> dict[int, dict[str, Any]]:
    """Every rank's last heartbeat in the run folder (rank -> record)."""
    found = {}
    for file in (Path(output_dir) / FAULTS_DIR).glob("heartbeat-rank*.json"):
        try:
            record = json.loads(file.read_text(encoding="utf-8"))
            found[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


__all__ = ["EXEMPT", "FAULTS_DIR", "HEARTBEAT_S", "Progress", "STALL_FACTOR", "STALL_FLOOR_S", "Watchdog",
           "exit_status", "heartbeat_file", "process_start_time", "read_heartbeats"]
