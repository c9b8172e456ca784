"""`adaptive fit` vs DeepSpeed's own model-state estimator, timed in one run as fresh processes.

    python bench/bench_fit.py [--repeats 7]

Each repeat starts a new Python process for both sides (what a user pays): ours runs the full
`adaptive fit --model b7 --gpu a100-40gb --json` (search, memory parts, throughput, ladder,
suggestions); DeepSpeed's side only imports and calls
`estimate_zero2_model_states_mem_needs_all_cold` for the same parameter count. Prints the medians
and their ratio (ours / DeepSpeed's), and each side's best run and CPU time (user + system of the child):
on a machine shared with other work the medians move with its load, the best CPU time much less.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = [sys.executable, "-m", "cli", "fit", "--model", "b7", "--gpu", "a100-40gb", "--json"]
DEEPSPEED = [sys.executable, "-c",
             "from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold as e;"
             "e(7241732096, num_gpus_per_node=1, num_nodes=1)"]


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one fresh process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
    _, _, usage = os.wait4(child.pid, 0)
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    ours, theirs = [], []
    for _ in range(args.repeats):  # interleaved so machine noise hits both alike
        ours.append(timed(OURS))
        theirs.append(timed(DEEPSPEED))
    o, t = statistics.median(w for w, _ in ours), statistics.median(w for w, _ in theirs)
    for name, runs, median in (("adaptive fit (full plan):           ", ours, o),
                               ("DeepSpeed estimate_zero2 (one call):", theirs, t)):
        print(f"{name} median {median * 1000:7.0f} ms over {args.repeats} runs; best {min(w for w, _ in runs) * 1000:.0f} "
              f"ms, CPU best {min(c for _, c in runs) * 1000:.0f} ms")
    print(f"ratio ours/DeepSpeed: {o / t:.3f} (target <= 0.10)")


if __name__ == "__main__":
    main()
