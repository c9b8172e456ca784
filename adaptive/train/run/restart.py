"""Is this process a restart of a run that failed, and what does it resume from?

A launcher that restarts failed workers says so in the environment: torchrun's elastic agent sets
TORCHELASTIC_RESTART_COUNT (0 on the first start, k on the k-th restart of the worker group;
torch/distributed/elastic/agent/server/local_elastic_agent.py), and Slurm sets SLURM_RESTART_COUNT
on a requeued job. Both are counted: a requeued job whose torchrun has not restarted yet is a restart.

A restart is the same command again, so it must not be refused as "a fresh run where a run exists",
must not delete what the failed attempt checkpointed (an --overwrite on the command line meant the
run before the first attempt), and resumes from the newest verified checkpoint of its run folder
without the user adding --resume; with none yet it starts fresh. No torch: the Slurm requeue path
reads it too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

RESTART_COUNT_VARS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many times this run has been restarted (0: the first start). Values that are not counts are 0."""
    environ = os.environ if environ is None else environ
    total = 0
    for name in RESTART_COUNT_VARS:
        value = environ.get(name, "").strip()
        if value.isdigit():
            total += int(value)
    return total


@dataclass(frozen=True)
class StartMode:
    """How a process takes its run folder: what it resumes, whether it may clear it, whether the
    fresh-start check applies (not to a restart: the folder holds this run's own earlier attempt)."""

    resume: str | None
    overwrite: bool
    check_fresh: bool
    restart: int = 0


def start_mode(resume: str | None, overwrite: bool, output_dir: Path,
               environ: Mapping[str, str] | None = None) -> StartMode:
    """The user's --resume/--overwrite on a first start; on a restart, the newest complete checkpoint of
    `output_dir` ('auto') when there is one, else the user's --resume PATH (None: a fresh start), never
    --overwrite. Sizes are checked here; the main process verifies the digests before it loads anything."""
    count = restart_count(environ)
    if count == 0:
        return StartMode(resume, overwrite, check_fresh=True)
    from adaptive.train.run_folder.checkpoint import find_checkpoint

    own = find_checkpoint("auto", Path(output_dir), digests=False) is not None
    # with none, a --resume auto (the first attempt started fresh, or resumed nothing) starts fresh again
    return StartMode("auto" if own else None if resume == "auto" else resume, False, check_fresh=False,
                     restart=count)


__all__ = ["RESTART_COUNT_VARS", "StartMode", "restart_count", "start_mode"]
