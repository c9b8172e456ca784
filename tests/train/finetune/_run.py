"""Launch a fine-tune the ways a user does, and read back what it left."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.train._launch import REPO, accelerate_launch, launch_env

DRIVER = Path(__file__).with_name("_ft_driver.py")
RECIPE = REPO / "recipes" / "finetune.py"
# one epoch of the 61 training rows at micro-batch 4 is 16 steps; a LoRA of rank 8 at lr 1e-2 learns the sums'
# pattern within it (the loss falls by about 0.7 nats) and a checkpoint every 4 steps gives the resume test its cut
FLAGS = ["--seq-len", "64", "--lr", "1e-2", "--log-every", "1", "--checkpoint-every", "4", "--no-progress"]
LORA_FLAGS = [*FLAGS, "--lora-rank", "8"]


def finetune(out: Path, flags: list[str], spec: dict | None = None, *, launcher: str = "python", nproc: int = 1,
             timeout: int = 300) -> subprocess.CompletedProcess:
    """The driver (recipes/finetune.py with test callbacks) on `flags` into run folder `out`: `python` (one
    process), `accelerate` (`accelerate launch --use_deepspeed`) or `torchrun` (`--nproc_per_node nproc`)."""
    home = out.parent / f"home-{out.name}"
    home.mkdir(parents=True, exist_ok=True)
    args = [str(DRIVER), json.dumps(spec or {}), "--", *flags, "--output-dir", str(out)]
    started = time.monotonic()
    if launcher == "accelerate":
        done = accelerate_launch(DRIVER, args[1:], nproc=nproc, home=home, timeout=timeout)
    else:
        prefix = [sys.executable] if launcher == "python" else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
        done = subprocess.run([*prefix, *args], cwd=REPO, env=launch_env(home), capture_output=True, text=True,
                              timeout=timeout)
    print(f"{out.name}: exit {done.returncode} in {time.monotonic() - started:.1f} s")
    return done


def losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    assert len(train) == len(dict(train)), "each step once"
    return dict(train)


def recorded(record: Path) -> dict:
    return json.loads((record / "run.json").read_text())
