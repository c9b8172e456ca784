"""Run one sweep point as a recipe run in a child process, and read its outcome from metrics.jsonl.

A child per point: the training stack keeps process-wide state (the process group, accelerate's singletons,
DeepSpeed's groups) that one run tears down at its end, so runs in one process do not follow each other
cleanly; a process costs ~5 s of imports. The child's output goes to POINT_DIR/train.log.

A rerun of a point resumes its newest checkpoint (`--resume auto`), harvests a run that finished but was not
recorded, and starts over (`--overwrite`) a run that never reached a checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from adaptive.durable import atomic_write_text
from adaptive.errors import AdaptiveError
from adaptive.record import record
from adaptive.scaling.grid import Point, SweepSettings
from adaptive.scaling.point import POINT_FILE

RUN_DIR = "run"
LOG_FILE = "train.log"
SKIPPED_LIMIT = 0.1  # more of a run's steps skipped for non-finite losses than this: it diverged
NON_FINITE_WORDS = ("nan", "inf", "non-finite")


@record
class Outcome:
    eval_loss: float
    seconds: float
    diverged: str | None = None  # why, when it did


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records (a half-written last line, from a killed run, is skipped)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def last_step(run_dir: Path) -> int:
    steps = [r.get("step", 0) for r in metrics(run_dir) if r.get("kind") in ("train", "start")]
    return max(steps, default=0)


def _end(run_dir: Path, point: Point) -> Outcome | None:
    """The outcome of a run that reached its end record, else None."""
    ends = [r for r in metrics(run_dir) if r.get("kind") == "end"]
    if not ends or ends[-1].get("step") != point.steps:
        return None
    end = ends[-1]
    loss = end.get("eval_loss")
    loss = float("nan") if loss is None else float(loss)
    seconds = 0.0  # the caller times the run it starts
    skipped = end.get("skipped_steps") or 0
    if not math.isfinite(loss):
        return Outcome(loss, seconds, f"final eval loss is {loss}")
    if skipped > SKIPPED_LIMIT * point.steps:
        return Outcome(loss, seconds, f"{skipped} of {point.steps} steps skipped for non-finite losses")
    return Outcome(loss, seconds)


def recipe_flags(point: Point, settings: SweepSettings, run_dir: Path) -> list[str]:
    """The recipe's flags for this point (the run options every recipe takes)."""
    every = max(50, point.steps // 4)
    flags = ["--output-dir", str(run_dir), "--dataset", settings.dataset, "--seq-len", str(settings.seq_len),
             "--seed", str(settings.seed + point.replica), "--lr", repr(settings.lr), "--max-steps", str(point.steps),
             "--micro-batch", str(settings.micro_batch), "--grad-accum", "1", "--orchestrator", "off",
             "--no-progress", "--log-every", "25", "--checkpoint-every", str(every),
             "--keep-checkpoints", "1", "--text-field", settings.text_field]
    if settings.tokenizer is not None:
        flags += ["--tokenizer", settings.tokenizer]
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        flags.append("--resume")
    elif run_dir.exists() and any(run_dir.iterdir()):
        flags.append("--overwrite")  # started, never checkpointed: nothing to keep
    return flags


def _child_env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))  # points side by side: a core each, not a fight
    root = str(Path(__file__).resolve().parents[2])  # the folder holding the `adaptive` package
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _error_line(log: Path) -> str:
    lines = [x for x in log.read_text(encoding="utf-8", errors="replace").splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error: ")]
    return (errors[-1].removeprefix("error: ") if errors else lines[-1] if lines else "no output").strip()


def run_point(point: Point, settings: SweepSettings, folder: Path, on_step: Callable[[int], None] | None = None,
              cancel: threading.Event | None = None, threads: int | None = None, poll_s: float = 0.5) -> Outcome:
    """Train `point` in `folder` (resuming what is there) and return its outcome; AdaptiveError (one line)
    when the run fails for another reason than diverging. `cancel` set: the child is stopped as Ctrl-C stops
    a recipe, and KeyboardInterrupt raised."""
    folder.mkdir(parents=True, exist_ok=True)
    run_dir = folder / RUN_DIR
    done = _end(run_dir, point)
    if done is not None:
        return done
    if not (folder / POINT_FILE).exists():
        atomic_write_text(folder / POINT_FILE, json.dumps(
            {"arch": point.arch, "width": point.width, "vocab_size": settings.vocab_size,
             "seq_len": settings.seq_len, "seed": settings.seed + point.replica}) + "\n")
    cmd = [sys.executable, "-m", "adaptive.scaling.point", str(folder), *recipe_flags(point, settings, run_dir)]
    log_path = folder / LOG_FILE
    began = time.monotonic()
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env(threads))
        try:
            while child.poll() is None:
                if cancel is not None and cancel.wait(poll_s):
                    raise KeyboardInterrupt
                if cancel is None:
                    time.sleep(poll_s)
                if on_step is not None:
                    on_step(last_step(run_dir))
        finally:
            if child.poll() is None:  # interrupted here: let the child stop as Ctrl-C stops a recipe
                child.send_signal(signal.SIGINT)
                try:
                    child.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
    outcome = _end(run_dir, point)
    if outcome is not None:
        return Outcome(outcome.eval_loss, time.monotonic() - began, outcome.diverged)
    line = _error_line(log_path)
    started = any(r.get("kind") == "start" for r in metrics(run_dir))
    if started and any(w in line.lower() for w in NON_FINITE_WORDS):
        return Outcome(float("nan"), time.monotonic() - began, line)
    raise AdaptiveError(f"sweep point {point.name} failed (exit {child.returncode}): {line} (log: {log_path})")


__all__ = ["LOG_FILE", "Outcome", "RUN_DIR", "last_step", "metrics", "recipe_flags", "run_point"]
