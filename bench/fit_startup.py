"""How long `adaptive fit` takes as a user runs it: fresh processes of an installed `adaptive`, best of N.

    python bench/fit_startup.py [--repeats 10] [--instructions] [--budget] [--finetune] ADAPTIVE [ADAPTIVE ...]

ADAPTIVE: the `adaptive` script of a venv (e.g. one per commit: `python3 -m venv V && V/bin/pip install .`).
For b7 (does not fit, so it also searches what would) and b1 (fits) on one A100-40GB, tables and --json, it
prints each executable's best and median wall time and best CPU time (user + system), the executables
interleaved run by run so the machine's load hits them alike. --instructions adds the instructions one run
executes (valgrind's callgrind; ~30 s a run): unlike time, they do not move with the load. --finetune adds the
README's 4090 fine-tune questions on examples/llama-3.1-8b/config.json (run from the repository root).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import time

CASES = (["--model", "b7", "--gpu", "a100-40gb"], ["--model", "b7", "--gpu", "a100-40gb", "--json"],
         ["--model", "b1", "--gpu", "a100-40gb"], ["--model", "b1", "--gpu", "a100-40gb", "--json"])
# --budget: the budget search (every arch over the size ladder), the slowest on 4 nodes of H100s
BUDGET_CASES = (["--budget-usd", "2000", "--gpu", "a100-80gb", "--gpus", "8"],
                ["--budget-usd", "1e6", "--gpu", "h100-80gb", "--gpus", "8", "--nodes", "4"],
                ["--budget-days", "7", "--gpu", "rtx4090-24gb", "--json"])
# --finetune: a downloaded config.json; a full fine-tune does not fit, so it also plans the LoRA, QLoRA and NVMe rungs
FINETUNE_CASES = tuple(["--model", "examples/llama-3.1-8b/config.json", "--gpu", "rtx4090", "--finetune", method, *extra]
                       for method, extra in (("full", []), ("lora", []), ("qlora", []), ("qlora", ["--json"])))


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one fresh process."""
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, _, usage = os.wait4(child.pid, 0)
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime


def instructions(cmd: list[str]) -> int:
    out = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *cmd],
                         capture_output=True, text=True).stderr
    return int(re.search(r"Collected : (\d+)", out).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adaptive", nargs="+")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--instructions", action="store_true")
    parser.add_argument("--budget", action="store_true", help="also time the budget search")
    parser.add_argument("--finetune", action="store_true", help="also time the 4090 fine-tune plans")
    args = parser.parse_args()
    print("load average:", open("/proc/loadavg").read().split()[:3])
    for case in CASES + (BUDGET_CASES if args.budget else ()) + (FINETUNE_CASES if args.finetune else ()):
        runs: dict[str, list[tuple[float, float]]] = {exe: [] for exe in args.adaptive}
        for _ in range(args.repeats):
            for exe in args.adaptive:
                runs[exe].append(timed([exe, "fit", *case]))
        for exe, r in runs.items():
            line = (f"{' '.join(case):58s} {exe}: wall best {min(w for w, _ in r) * 1000:4.0f} ms, median "
                    f"{statistics.median(w for w, _ in r) * 1000:4.0f} ms; CPU best {min(c for _, c in r) * 1000:4.0f} ms")
            if args.instructions:
                line += f"; {instructions([exe, 'fit', *case]) / 1e6:,.0f}M instructions"
            print(line, flush=True)
    print("load average:", open("/proc/loadavg").read().split()[:3])


if __name__ == "__main__":
    main()
