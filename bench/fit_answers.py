"""Dump `adaptive fit` answers (--json and the tables) for a broad set of cases, to diff before/after a
planner change that must not change any answer (issue 10's speed work).

    PYTHONPATH=. python bench/fit_answers.py OUT_DIR [--reverse]

Each case writes OUT_DIR/NNN.json (the --json output) and OUT_DIR/NNN.txt (the tables), plus the exit code.
Runs in one process (cli.main.run); --reverse runs the cases in the opposite order (a cache that leaked
state between requests would show up as a difference). Compare two folders with `diff -r`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["COLUMNS"] = "200"

PRESETS = ("debug", "debug_200m", "b1", "b7", "b14", "b30", "b70")
ARCHS = ("dense", "moe", "mod", "hybrid")
GPUS = ("a100-40gb", "h100-80gb", "rtx4090-24gb", "t4-16gb")
NODES = ((1, 1), (8, 1), (8, 4))
ROOT = Path(__file__).resolve().parent.parent
ZERO2 = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "bf16": {"enabled": "auto"}, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}},
         "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e8,
                               "allgather_bucket_size": 5e8}}


def cases(tmp: Path) -> list[list[str]]:
    out = []
    for p in PRESETS:
        for a in ARCHS:
            for g in GPUS:
                for gpn, n in NODES:
                    out.append(["--model", p, "--arch", a, "--gpu", g, "--gpus", str(gpn), "--nodes", str(n)])
    ds = tmp / "ds.json"
    ds.write_text(json.dumps(ZERO2))
    hf8 = str(ROOT / "tests/plan/data/llama-3.1-8b/config.json")
    hf405 = str(ROOT / "tests/plan/data/llama-3.1-405b/config.json")
    b = ["--model", "b7", "--gpu", "a100-40gb"]
    extra = [
        b, b + ["--gpus", "8"], b + ["--gpus", "8", "--nodes", "4"],
        b + ["--zero", "3"], b + ["--zero", "2", "--offload", "optimizer"], b + ["--offload", "all"],
        b + ["--micro-batch", "2"], b + ["--grad-accum", "16"], b + ["--no-checkpointing"], b + ["--checkpointing"],
        b + ["--checkpoint-policy", "selective"], b + ["--checkpoint-policy", "mlp"],
        b + ["--checkpoint-policy", "every:2"], b + ["--min-seq-len", "256"], b + ["--seq-len", "8192"],
        b + ["--seq-len", "4096", "--min-seq-len", "512"], b + ["--kernels", "plain"], b + ["--attention", "eager"],
        b + ["--optimizer", "adamw_torch"], b + ["--global-batch-tokens", "524288"], b + ["--host-mem", "512"],
        b + ["--mfu", "0.5"], b + ["--gpu-mem", "60"], b + ["--tokens", "1e9"],
        ["--model", "b70", "--gpu", "h100-80gb", "--gpus", "8", "--nodes", "8"],
        ["--model", "b70", "--gpu", "h100-80gb", "--gpus", "8", "--nodes", "4", "--sp-size", "8"],
        ["--model", "b70", "--gpu", "h100-80gb", "--gpus", "8", "--nodes", "4", "--tp-size", "4"],
        ["--model", "b70", "--gpu", "h100-80gb", "--gpus", "8", "--nodes", "4", "--tp-size", "2", "--sp-size", "2"],
        ["--model", "b70", "--gpu", "h100-80gb", "--gpus", "8", "--nodes", "4", "--zero-hpz", "8"],
        ["--model", "b70", "--gpu", "h100-80gb", "--gpus", "8", "--nodes", "4", "--zero-quantize", "both"],
        ["--model", "b70", "--gpu", "a100-80gb", "--gpus", "8", "--nodes", "2", "--seq-len", "16384",
         "--min-seq-len", "2048"],
        ["--model", "b30", "--arch", "moe", "--gpu", "h100-80gb", "--gpus", "8", "--nodes", "2", "--ep-size", "4"],
        ["--model", "b14", "--arch", "moe", "--gpu", "a100-80gb", "--gpus", "8", "--capacity-factor", "1.25"],
        ["--model", "b7", "--arch", "mod", "--gpu", "a100-80gb", "--mod-capacity", "0.25"],
        ["--model", "b14", "--gpu", "h100-80gb", "--gpus", "4", "--sp-size", "4", "--seq-len", "32768"],
        ["--model", "b1", "--gpu", "a100-80gb", "--gpus", "8", "--ds-config", str(ds)],
        ["--model", "b7", "--gpu", "a100-40gb", "--gpus", "8", "--ds-config", str(ds)],
        ["--model", hf8, "--gpu", "a100-80gb", "--gpus", "8"], ["--model", hf8, "--gpu", "a100-40gb"],
        ["--model", hf405, "--gpu", "h100-80gb", "--gpus", "8", "--nodes", "16"],
        ["--model", "b7", "--gpu", "v100-32gb", "--gpus", "8", "--zero", "2", "--micro-batch", "1",
         "--seq-len", "1024", "--checkpointing", "--optimizer", "adamw_torch"],
        ["--model", "b70", "--gpu", "rtx4090-24gb"], ["--model", "b70", "--arch", "moe", "--gpu", "t4-16gb"],
        ["--model", "b1", "--gpu", "mi300x-192gb", "--gpus", "8", "--nodes", "2"],
    ]
    return out + extra


def main() -> None:
    from cli.main import run

    dest = Path(sys.argv[1])
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        all_cases = list(enumerate(cases(Path(tmp))))
        if "--reverse" in sys.argv:
            all_cases.reverse()
        for i, argv in all_cases:
            for suffix, more in (("json", ["--json"]), ("txt", [])):
                buf, err = io.StringIO(), io.StringIO()
                with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
                    rc = run(["fit", *argv, *more])
                text = buf.getvalue().replace(tmp, "TMP")
                (dest / f"{i:03d}.{suffix}").write_text(
                    " ".join(argv).replace(tmp, "TMP") + f"\nrc={rc}\n{text}{err.getvalue()}")
    print(f"{len(all_cases)} cases -> {dest}")


if __name__ == "__main__":
    main()
