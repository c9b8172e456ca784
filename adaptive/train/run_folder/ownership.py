"""A run folder is owned: one run writes into it at a time, and a fresh run never writes over another's.

- A fresh run (no `--resume`) into a folder that holds a run is refused, naming `--resume` and
  `--overwrite`; `--overwrite` deletes the old run's files first (`clear_run`).
- A lock file (`.adaptive.lock`, an exclusive `flock` held by the main process for the whole run)
  refuses a second writer. The kernel drops the lock when the process dies, however it dies.
- The configs `adaptive launch` writes (plan.json, ds_config.json, accelerate_config.yaml) are not a
  run: launch writes them before the recipe starts.

No torch: `adaptive launch` runs the same check before it writes anything.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
from pathlib import Path

from adaptive.errors import AdaptiveError

LOCK_FILE = ".adaptive.lock"
RUN_FILES = ("metrics.jsonl", "events.jsonl", "report.png")  # what a run writes as it trains
RUN_FOLDERS = ("checkpoints", "hf", "trackers", "faults")  # and hf-step_N/


def run_files(folder: Path) -> list[str]:
    """The files and folders of a run already in `folder` (empty: nothing a run wrote)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [name for name in RUN_FILES if (folder / name).is_file()]
    found += [name for name in RUN_FOLDERS if (folder / name).is_dir() and any((folder / name).iterdir())]
    found += sorted(p.name for p in folder.glob("hf-step_*") if p.is_dir())
    return found


def check_fresh_start(folder: Path, resume: str | None, overwrite: bool) -> None:
    """Refuse a fresh run where a run exists, before anything is written (every rank may call it)."""
    if resume is not None or overwrite:
        return
    found = run_files(folder)
    if found:
        raise AdaptiveError(f"{folder} already holds a run ({', '.join(found[:3])}); pass --resume to continue it, "
                            "--overwrite to replace it, or another --output-dir")


def starts_fresh(folder: Path, resume: str | None) -> bool:
    """`--resume auto` where there is nothing to resume: the folder holds no run (no checkpoint, metrics or
    export), so the run starts fresh and says so. A folder whose run cannot be resumed is refused instead."""
    return resume == "auto" and not run_files(folder)


def clear_run(folder: Path) -> list[str]:
    """Delete a previous run's files (`--overwrite`); the configs stay. Returns what was deleted."""
    found = run_files(folder)
    for name in found:
        path = Path(folder) / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return found


class RunLock:
    """An exclusive, non-blocking flock on `<folder>/.adaptive.lock` naming its holder."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise AdaptiveError(f"cannot write to the run folder {self.path.parent}: {err.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _read(fd)
            os.close(fd)
            if err.errno in (errno.EAGAIN, errno.EACCES):
                raise AdaptiveError(f"{self.path.parent} is in use by another run ({holder or 'holder unknown'}); "
                                    "wait for it to end, or pass another --output-dir") from None
            raise AdaptiveError(f"cannot lock the run folder {self.path.parent}: {err.strerror}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock; the file stays (deleting it would race a new holder)
            self.fd = None


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""


__all__ = ["LOCK_FILE", "RunLock", "check_fresh_start", "clear_run", "run_files", "starts_fresh"]
