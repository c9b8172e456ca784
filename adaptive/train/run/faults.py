"""When one rank of a run fails, every rank stops, and one line says which rank and why.

Three ways a rank meets a failure, one way out (`stop_run`):

- its own exception (a data file it cannot read, a bug): it is the culprit;
- a collective that fails under it (a peer died: the connection closed; a peer hangs: the collective
  timeout, --collective-timeout, ran out);
- its watchdog (`adaptive.train.run.watchdog`): its step ran far longer than the run's steps.

A rank that cannot speak (killed, or stopped by SIGSTOP) is named by the others from the heartbeats
every rank writes to RUN/faults/ (`diagnose`): a rank that wrote its own fault record first; else one
whose process on this host is gone (with the signal that killed it, when the kernel still holds its
exit status); else one whose heartbeat stopped HEARTBEAT_S x STALE_BEATS seconds ago; else the one
furthest behind (lowest step, then earliest phase). The culprit's own line, or else the line of the
lowest-numbered rank still alive, is the one line printed; the other ranks stop quietly.

Each stopping rank writes every thread's stack (faulthandler) to RUN/faults/stacks-rank<r>.txt. The
line's author appends the failure to events.jsonl (kind "fault": rank, step, phase, reason, restart,
reported_by) and writes RUN/faults/fault-rank<r>.json. Then the process ends with os._exit(1): its main
thread may be inside a collective that will never return, and the elastic agent reads any non-zero
exit as a failure (it restarts the workers, --max-restarts, or stops them).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

from adaptive.durable import atomic_write_text
from adaptive.train.run.watchdog import FAULTS_DIR, HEARTBEAT_S, Progress, exit_status, read_heartbeats

EVENTS_FILE = "events.jsonl"  # the orchestrator's decision log; a fault or restart is history it keeps
STALE_BEATS = 4  # heartbeats missed before a rank counts as not responding
DIAGNOSE_WAIT_S = HEARTBEAT_S * STALE_BEATS  # long enough for a dead peer on another host to go stale
EXIT_CODE = 1
PHASE_ORDER = ("start", "data", "forward", "backward", "pipeline", "optimizer", "sync", "checkpoint", "eval", "export", "done")

_stopping = threading.Lock()


@dataclass(frozen=True)
class Culprit:
    rank: int
    reason: str
    step: int | None = None
    phase: str | None = None
    spoke: bool = False  # it wrote its own fault record (its line is already out)


def fault_file(output_dir: Path, rank: int) -> Path:
    return Path(output_dir) / FAULTS_DIR / f"fault-rank{rank}.json"


def stacks_file(output_dir: Path, rank: int) -> Path:
    return Path(output_dir) / FAULTS_DIR / f"stacks-rank{rank}.txt"


def append_event(output_dir: Path, record: dict[str, Any]) -> None:
    """One line appended to events.jsonl (O_APPEND: lines of several writers do not interleave)."""
    try:
        with open(Path(output_dir) / EVENTS_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        pass


def read_faults(output_dir: Path, restart: int) -> dict[int, dict[str, Any]]:
    """The fault records of this attempt (rank -> record)."""
    found = {}
    for file in (Path(output_dir) / FAULTS_DIR).glob("fault-rank*.json"):
        try:
            record = json.loads(file.read_text(encoding="utf-8"))
            if record.get("restart") == restart:
                found[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def diagnose(output_dir: Path, rank: int, restart: int, wait: float | None = None,
             here: tuple[int, str] = (0, "start")) -> Culprit | None:
    """The rank this one is waiting for, from the heartbeats and fault records of this attempt (polled for up to
    `wait` seconds: a peer on another host is known dead only when its heartbeat goes stale). `here`: this rank's
    (step, phase). None: every peer is alive and no peer is behind this rank (this rank itself may be)."""
    deadline = time.monotonic() + (DIAGNOSE_WAIT_S if wait is None else wait)
    host = socket.gethostname()
    while True:
        faults = read_faults(output_dir, restart)
        if faults:
            first = min(faults.values(), key=lambda r: r.get("time", 0.0))
            return Culprit(first["rank"], first["reason"], first.get("step"), first.get("phase"), spoke=True)
        beats = {r: b for r, b in read_heartbeats(output_dir).items() if b.get("restart") == restart and r != rank}
        for r, beat in sorted(beats.items()):
            if beat.get("host") == host and isinstance(beat.get("pid"), int):
                state, status = exit_status(beat["pid"])
                if state != "alive":
                    return Culprit(r, _death(beat["pid"], status), beat.get("step"), beat.get("phase"))
        now = time.time()
        stale = {r: now - b["time"] for r, b in beats.items() if now - b.get("time", now) > HEARTBEAT_S * STALE_BEATS}
        if stale:
            r = max(stale, key=stale.get)
            return Culprit(r, f"not responding: no heartbeat for {stale[r]:.0f} s", beats[r].get("step"),
                           beats[r].get("phase"))
        if time.monotonic() >= deadline:
            return _behind(beats, rank, here)
        time.sleep(0.02)  # a dead local peer is a zombie only until its launcher reaps it (0.1 s)


def _death(pid: int, status: int | None) -> str:
    if status is not None and os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        return f"killed by signal {number} ({signal.Signals(number).name})"
    if status is not None and os.WIFEXITED(status):
        return f"its process exited with code {os.WEXITSTATUS(status)}"
    return f"its process {pid} is gone (killed or exited; the launcher's report gives the signal)"


def _behind(beats: dict[int, dict[str, Any]], rank: int, here: tuple[int, str]) -> Culprit | None:
    """The peer least far along (step, then phase) when it is behind this rank or another peer; None when this rank
    is itself among the furthest behind (its own watchdog says why), or every rank is level."""
    def position(step: Any, phase: Any) -> tuple[int, int]:
        return (step if isinstance(step, int) else 0), (PHASE_ORDER.index(phase) if phase in PHASE_ORDER else 0)

    where = {r: position(b.get("step"), b.get("phase")) for r, b in beats.items()}
    where[rank] = position(*here)
    slowest = min(where.values())
    behind = sorted(r for r, p in where.items() if p == slowest)
    if rank in behind or len(behind) == len(where):
        return None
    culprit, beat = behind[0], beats[behind[0]]
    return Culprit(culprit, f"behind: still in step {beat.get('step')} ({beat.get('phase')})", beat.get("step"),
                   beat.get("phase"))


def dump_stacks(output_dir: Path, rank: int, headline: str) -> Path | None:
    path = stacks_file(output_dir, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(headline + "\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        return path
    except OSError:
        return None


def stop_run(output_dir: Path, rank: int, restart: int, progress: Progress, *, own_reason: str | None = None,
             waited: str | None = None, trace: str = "", exit_now: bool = True) -> Culprit:
    """Stop this rank for a failure. `own_reason`: this rank failed itself (an exception). `waited`: what this
    rank saw (a failed collective, its watchdog): the culprit is diagnosed. Writes the stacks, the record and
    the one line when this rank is the one to say it, then ends the process (`exit_now`)."""
    if not _stopping.acquire(blocking=False):  # the other path (watchdog or main thread) is already at it
        if exit_now:
            threading.Event().wait()  # the first caller ends the process
        return Culprit(rank, "already stopping")
    step, phase = progress.step, progress.phase
    if own_reason is not None:
        culprit = Culprit(rank, own_reason, step, phase)
    else:
        culprit = diagnose(output_dir, rank, restart, here=(step, phase)) or Culprit(rank, waited or "stopped",
                                                                                      step, phase)
    if culprit.rank != rank and not culprit.spoke:  # a silent peer: the step is the one the collective belongs to
        # its heartbeat may be older than the step: it was in the step this rank waits in, at or before this phase
        culprit = replace(culprit, step=step, phase=culprit.phase if culprit.step == step else phase)
    here = f"rank {rank} at step {step} ({phase})"
    dump_stacks(output_dir, rank, f"{here}: {waited or own_reason}; culprit: rank {culprit.rank}: {culprit.reason}"
                + (f"\n\n{trace}" if trace else ""))
    if not culprit.spoke and _speaks(output_dir, rank, restart, culprit):
        where = f"step {culprit.step}" + (f" ({culprit.phase})" if culprit.phase else "")
        line = f"rank {culprit.rank} failed at {where}: {culprit.reason}"
        if culprit.rank != rank:
            line += f" (seen by rank {rank}: {waited})"
        record = {"kind": "fault", "rank": culprit.rank, "step": culprit.step, "phase": culprit.phase,
                  "reason": culprit.reason, "restart": restart, "reported_by": rank, "time": time.time()}
        _write_fault(output_dir, rank, record)
        append_event(output_dir, record)
        if culprit.rank != rank:  # torchrun's failure summary names this rank: say there whom it waited for
            _record_for_torchelastic(RuntimeError(line))
        sys.stderr.write(f"{line}; every rank stops (stacks and heartbeats in {Path(output_dir) / FAULTS_DIR})\n")
    sys.stderr.flush()
    sys.stdout.flush()
    if exit_now:
        os._exit(EXIT_CODE)
    return culprit


def _speaks(output_dir: Path, rank: int, restart: int, culprit: Culprit) -> bool:
    """The culprit speaks for itself; for a silent one, the lowest-numbered rank whose heartbeat is fresh."""
    if culprit.rank == rank:
        return True
    now = time.time()
    alive = [r for r, b in read_heartbeats(output_dir).items()
             if b.get("restart") == restart and r != culprit.rank and now - b.get("time", 0.0) <= HEARTBEAT_S * STALE_BEATS]
    return not alive or rank <= min(alive)


def _write_fault(output_dir: Path, rank: int, record: dict[str, Any]) -> None:
    path = fault_file(output_dir, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(record))
    except OSError:
        pass


def record_own_failure(output_dir: Path, rank: int, restart: int, progress: Progress, reason: str) -> None:
    """This rank's own failure, written before it ends (AdaptiveError: its one line is printed by the recipe):
    the peers find it and stay quiet."""
    record = {"kind": "fault", "rank": rank, "step": progress.step, "phase": progress.phase, "reason": reason,
              "restart": restart, "reported_by": rank, "time": time.time()}
    _write_fault(output_dir, rank, record)
    append_event(output_dir, record)


@contextmanager
def guarded(output_dir: Path, rank: int, world_size: int, restart: int, progress: Progress,
            collective_timeout: float) -> Iterator[None]:
    """Train inside this: the watchdog runs (heartbeats, the stall check), and with several processes a failure
    stops this rank through `stop_run` (AdaptiveError, bad input or a full disk, keeps its own one line and exit
    code 2; its record tells the peers who failed)."""
    from adaptive.engine import collective_failure
    from adaptive.errors import AdaptiveError
    from adaptive.train.run.watchdog import Watchdog, heartbeat_file

    for own in (fault_file(output_dir, rank), heartbeat_file(output_dir, rank)):  # a past run's
        own.unlink(missing_ok=True)

    def stalled(seconds: float) -> None:
        stop_run(output_dir, rank, restart, progress, waited=f"no progress for {seconds:.0f} s in {progress.phase}")

    watchdog = Watchdog(progress, output_dir, rank, restart, collective_timeout, stalled)
    watchdog.start()
    try:
        yield
    except AdaptiveError as err:
        if world_size > 1:
            record_own_failure(output_dir, rank, restart, progress, str(err))
        raise
    except Exception as err:
        if world_size == 1:
            raise
        if threading.current_thread() is threading.main_thread():
            # the launcher SIGTERMs every worker as soon as one fails, and the loop's handler is gone with the
            # loop: this rank is stopping already, and must live the few seconds it takes to say why
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if collective_failure(err):
            stop_run(output_dir, rank, restart, progress, waited=f"its collective in {progress.phase} failed",
                     trace=exception_reason(err))
        _record_for_torchelastic(err)
        stop_run(output_dir, rank, restart, progress, own_reason=exception_reason(err),
                 trace="".join(traceback.format_exception(err)))
    finally:
        progress.phase = "done"
        watchdog.stop()


def _record_for_torchelastic(err: BaseException) -> None:
    """torchrun's report of the failed worker reads TORCHELASTIC_ERROR_FILE; torch's own ErrorHandler writes it."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(err)
    except Exception:  # the report is a courtesy; the fault record and the line are written next
        pass


def exception_reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300]}" if text else type(err).__name__


__all__ = ["Culprit", "EXIT_CODE", "append_event", "diagnose", "dump_stacks",
           "exception_reason", "fault_file", "guarded", "read_faults", "record_own_failure", "stacks_file", "stop_run"]
