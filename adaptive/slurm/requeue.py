"""What a requeued Slurm job asks before it starts the run again: does the run folder hold a complete
checkpoint? Exit 0: resume from it (`--resume auto`); 1: start over. The batch script runs it once, on
the job's first node, when SLURM_RESTART_COUNT > 0 (`adaptive.slurm.batch`).

    python -m adaptive.slurm.requeue RUN_DIR

Torch-free, so a requeued job starts at once: a checkpoint folder gets its step name only when it is
complete (written as .tmp-step_N, manifest last, then renamed: adaptive.train.run_folder.checkpoint),
so a `step_N` folder with its COMPLETE.json is one. The run's resume verifies sizes and digests, and
falls back to an older checkpoint.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

CHECKPOINTS, MANIFEST = "checkpoints", "COMPLETE.json"  # adaptive.train.run_folder.checkpoint's names
_STEP_DIR = re.compile(r"^step_\d+$")


def has_checkpoint(run_dir: Path) -> bool:
    root = Path(run_dir) / CHECKPOINTS
    return root.is_dir() and any(_STEP_DIR.match(p.name) and (p / MANIFEST).is_file() for p in root.iterdir())


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m adaptive.slurm.requeue RUN_DIR\n")
        return 2
    return 0 if has_checkpoint(Path(argv[0])) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
