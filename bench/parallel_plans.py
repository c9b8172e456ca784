"""What `adaptive fit` plans for the runs issue 12 names (AutoTP, Ulysses SP, ZeRO++), and how long it takes.

    python bench/parallel_plans.py

One markdown table: the plan's knobs, peak per GPU, tokens/s, MFU, the step's parts, and the wall time of
`fit()` in this process (first call, then the best of 5 with warm caches). docs/BENCHMARKS.md holds its
output.
"""

from __future__ import annotations

import time
from pathlib import Path

from adaptive.plan import fit, make_request
from adaptive.plan.search.planner import describe

DATA = Path(__file__).resolve().parents[1] / "tests" / "plan" / "data"
RUNS = {
    "Llama-3.1-405B, 8,192 x H100, 16M tokens, seq 8192": dict(
        model=str(DATA / "llama-3.1-405b" / "config.json"), gpu="h100-80gb", gpus=8, nodes=1024, seq_len=8192,
        global_batch_tokens=16 * 2**20),
    "Llama-2-70B shape (b70), 2,048 x A100-80GB, 4M tokens, seq 4096": dict(
        model="b70", gpu="a100-80gb", gpus=8, nodes=256, seq_len=4096, global_batch_tokens=4 * 2**20),
    "b70 MoE, 64 x H100 (host RAM 3x GPU memory)": dict(model="b70", arch="moe", gpu="h100-80gb", gpus=8, nodes=8),
    "b70 MoE, 64 x H100, --host-mem 2600": dict(model="b70", arch="moe", gpu="h100-80gb", gpus=8, nodes=8,
                                                 host_mem_gib=2600),
    "Llama-3.1-8B, 8 x H100, seq 131072": dict(model=str(DATA / "llama-3.1-8b" / "config.json"), gpu="h100-80gb",
                                               gpus=8, seq_len=131072),
    "b7, 1 x A100-40GB (README)": dict(model="b7", gpu="a100-40gb"),
}


def main() -> None:
    print("| run | fits | plan | peak GiB | tokens/s | MFU | step s: compute / ZeRO exposed / TP / SP / MoE a2a / "
          "offload | fit() first / warm |")
    print("|---|---|---|---|---|---|---|---|")
    for name, kw in RUNS.items():
        start = time.perf_counter()
        plan = fit(make_request(**kw))
        first = time.perf_counter() - start
        warm = min(_timed(kw) for _ in range(5))
        c, t = plan.shown, plan.shown.throughput
        parts = " / ".join(f"{x:.2f}" for x in (t.compute_seconds, t.comm_seconds, t.tp_allreduce_seconds,
                                                 t.sp_alltoall_seconds, t.alltoall_seconds, t.offload_seconds))
        print(f"| {name} | {'yes' if plan.fits else 'no'} | {describe(c)}, {c.setup.dp_size} replicas | "
              f"{c.memory.peak_gpu_bytes / 2**30:.1f} | {t.tokens_per_second:,.0f} | {t.mfu:.1%} | {parts} | "
              f"{first * 1000:.0f} / {warm * 1000:.0f} ms |")


def _timed(kw: dict) -> float:
    start = time.perf_counter()
    fit(make_request(**kw))
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
