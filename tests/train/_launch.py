"""Run a recipe (or the test driver) the way a user does: `accelerate launch`, in a clean environment."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("_driver.py")
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(home: Path, **extra: str) -> dict[str, str]:
    """Offline, one thread per process, no rank variables, and a private HF_HOME so no user
    accelerate config is read."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS and not k.startswith("ACCELERATE_")}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               HF_HOME=str(home), TOKENIZERS_PARALLELISM="false", **extra)
    if shutil.which("ninja") is None:  # DeepSpeed builds its CPU comm op with ninja; the venv ships one
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def accelerate_launch(script: Path | str, args: list[str], *, nproc: int = 1, launch_args: list[str] | None = None,
                      home: Path, timeout: int = 300, **extra_env: str) -> subprocess.CompletedProcess:
    """`accelerate launch [launch_args] script args`; by default `--use_deepspeed --num_processes N`."""
    launch_args = launch_args if launch_args is not None else ["--use_deepspeed", "--num_processes", str(nproc)]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(free_port()), *launch_args, str(script), *args]
    return subprocess.run(cmd, cwd=REPO, env=launch_env(home, **extra_env), capture_output=True, text=True,
                          timeout=timeout)


def driver(preset: str, arch: str, spec: dict, args: list[str], **kw) -> subprocess.CompletedProcess:
    return accelerate_launch(DRIVER, [preset, arch, json.dumps(spec), "--", *args], **kw)


def records(run_dir: Path, kind: str | None = None) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if kind is None or r["kind"] == kind]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir, "train")}


def tail(done: subprocess.CompletedProcess, n: int = 4000) -> str:
    return (done.stdout + done.stderr)[-n:]
