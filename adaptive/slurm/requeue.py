"""What a requeued Slurm job asks before it starts the run again: does the run folder hold a complete
checkpoint? Exit 0: resume from it (`--resume auto`); 1: start over. The batch script runs it once, on
the job's first node, when SLURM_RESTART_COUNT > 0 (`adaptive.slurm.batch`).

    python -m adaptive.slurm.requeue RUN_DIR

Sizes are checked here, digests by the run's own resume (which falls back to an older checkpoint).
"""

from __future__ import annotations

import sys
from pathlib import Path


def has_checkpoint(run_dir: Path) -> bool:
    from adaptive.train.run_folder.checkpoint import find_checkpoint

    return find_checkpoint("auto", Path(run_dir), digests=False) is not None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m adaptive.slurm.requeue RUN_DIR\n")
        return 2
    return 0 if has_checkpoint(Path(argv[0])) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
