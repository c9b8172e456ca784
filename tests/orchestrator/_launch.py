"""The two debug-MoE runs the fault tests share (see test_faults.py), started together: they are
single-threaded, and the machine has two cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.train._launch import REPO, free_port, launch_env

DRIVER = Path(__file__).with_name("_driver.py")
NAN_AT = [11, 13, 14]
SPECS = {"clean": {"nan_at": NAN_AT}, "faulty": {"oom_at": [5, 7], "nan_at": NAN_AT}}
FLAGS = ["--max-steps", "16", "--log-every", "1", "--seq-len", "64", "--micro-batch", "2", "--grad-accum", "2",
         "--checkpoint-every", "10", "--no-progress", "--orchestrator", "on",
         "--orchestrator-config", json.dumps({"guard": {"window": 5, "lr_steps": 3}})]


def _command(spec: dict, out: Path, extra: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", str(free_port()), "--use_deepspeed", "--num_processes",
            "1", str(DRIVER), "debug", "moe", json.dumps({**spec, "record": str(out / "recorded")}), "--", *FLAGS,
            "--output-dir", str(out), *extra]


def run_one(spec: dict, out: Path, root: Path, extra: list[str]) -> None:
    """One more run of the driver (e.g. a --resume), alone."""
    home = root / "home"
    home.mkdir(parents=True, exist_ok=True)
    with open(root / "run.log", "w") as log:
        code = subprocess.run(_command(spec, out, extra), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                              env=launch_env(home, ADAPTIVE_CACHE=str(home / "cache")), timeout=600).returncode
    assert code == 0, (root / "run.log").read_text()[-3000:]


def start_fault_runs(root: Path) -> dict[str, Path]:
    procs = {}
    for name, spec in SPECS.items():
        home = root / f"home_{name}"  # own caches: the two runs fill them at the same time
        home.mkdir(parents=True)
        out = root / name
        log = open(root / f"{name}.log", "w")
        procs[name] = (subprocess.Popen(_command(spec, out), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                        env=launch_env(home, ADAPTIVE_CACHE=str(home / "cache"))), out, log)
    failed = []
    for name, (proc, out, log) in procs.items():
        code = proc.wait(timeout=600)
        log.close()
        if code != 0:
            failed.append(f"{name} exited {code}:\n" + (root / f"{name}.log").read_text()[-3000:])
    assert not failed, "\n".join(failed)
    return {name: out for name, (_, out, _) in procs.items()}


def read_records(run_dir: Path, kind: str | None = None, file: str = "metrics.jsonl") -> list[dict]:
    lines = (Path(run_dir) / file).read_text().splitlines()
    return [r for r in map(json.loads, lines) if kind is None or r.get("kind") == kind]


def recorded_events(run_dir: Path) -> list[dict]:
    return json.loads((Path(run_dir) / "recorded" / "events_rank0.json").read_text())
