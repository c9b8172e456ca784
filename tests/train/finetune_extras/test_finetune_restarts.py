"""`adaptive launch --max-restarts 1` restarts a LoRA fine-tune whose rank 1 was SIGKILLed mid-step (two CPU
processes under torchrun's agent): the restarted workers resume the newest complete checkpoint (the trained
parameters only, a LoRA checkpoint) and end with the per-step losses of the uninterrupted run, bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.train.finetune._checkpoints import write_chat, write_llama
from tests.train._launch import REPO, launch_env

pytestmark = pytest.mark.slow  # two 2-process fine-tunes, one of them restarted

RECIPE = REPO / "tests" / "train" / "finetune_extras" / "_fault_finetune.py"
FLAGS = ["--max-steps", "8", "--log-every", "1", "--checkpoint-every", "2", "--seq-len", "64", "--micro-batch", "2",
         "--lr", "1e-3", "--no-progress"]


def launch(root, name: str, checkpoint, data, fault: dict | None, *extra: str) -> tuple[subprocess.CompletedProcess, object]:
    out, home = root / name, root / f"home-{name}"
    home.mkdir()
    env = launch_env(home, ADAPTIVE_CACHE=str(root / "cache"), COLUMNS="200",
                     **({"FAULT": json.dumps(fault)} if fault else {}))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "cli", "launch", str(RECIPE), "--gpus", "2", "--init-from",
                           str(checkpoint), "--dataset", str(data), *FLAGS, *extra, "--output-dir", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    print(f"{name}: exit {done.returncode} in {time.monotonic() - started:.1f} s")
    return done, out


def losses(out) -> dict[int, float]:
    train = [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert len(train) == len(dict(train)), "each step once: a restart drops the records of the steps it redoes"
    return dict(train)


def test_a_killed_rank_of_a_lora_fine_tune_restarts_and_ends_with_the_uninterrupted_losses(tmp_path):
    checkpoint, data = write_llama(tmp_path / "tiny-llama"), write_chat(tmp_path / "chat.jsonl")
    done, baseline = launch(tmp_path, "baseline", checkpoint, data, None)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    done, out = launch(tmp_path, "restarted", checkpoint, data, {"rank": 1, "step": 5, "fault": "sigkill"},
                       "--max-restarts", "1")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "--max_restarts 1" in done.stdout
    assert losses(out) == losses(baseline) and len(losses(out)) == 8
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["rank"] if e["kind"] == "fault" else e["step"]) for e in events
            if e["kind"] in ("fault", "restart")] == [("fault", 1), ("restart", 4)]
    start = next(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line)["kind"] == "start")
    assert start["finetune"] == "lora" and start["world_size"] == 2
    assert (out / "adapter" / "adapter_config.json").is_file()
