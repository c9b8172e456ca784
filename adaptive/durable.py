"""Durable writes: a reader (or a crash) sees the old file or folder, or the new one, never half of one.

Every replace is "write the new one beside it, fsync, rename over, fsync the folder, then delete the
old one". Temporary names carry the process id, so two processes never share one. No torch: the
planner side and the orchestrator use these too.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root`, then `root` itself."""
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_path(Path(folder) / name)
        fsync_path(Path(folder))


def temporary_name(path: Path, tag: str = "tmp") -> Path:
    """A hidden sibling of `path` that no other process picks."""
    path = Path(path)
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}")


def atomic_write_text(path: Path, text: str) -> None:
    """Write-temp, fsync, os.replace, fsync the folder: readers see the old or the new file."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    import ctypes  # here, not at the top: `adaptive fit` writes plan files through this module, never swaps folders

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2  # the C library this Python runs on
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    done = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    return done == 0


def replace_dir(new: Path, target: Path) -> None:
    """Move the finished folder `new` to `target`, replacing what is there; the old one is deleted only
    after the new one is in place. `new` must be fsynced by the caller."""
    new, target = Path(new), Path(target)
    if not target.exists():
        os.rename(new, target)
    elif _exchange(new, target):  # `new` now holds the old folder
        fsync_path(target.parent)
        shutil.rmtree(new, ignore_errors=True)
        return
    else:  # two renames; between them the old folder lies beside, whole, under a hidden name
        old = temporary_name(target, "old")
        os.rename(target, old)
        os.rename(new, target)
        fsync_path(target.parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    fsync_path(target.parent)


__all__ = ["atomic_write_text", "fsync_path", "fsync_tree", "replace_dir", "temporary_name"]
