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


def _command(spec: dict, out: Path, extra: list[str] = (), flags: list[str] = FLAGS) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", str(free_port()), "--use_deepspeed", "--num_processes",
            "1", str(DRIVER), "debug", "moe", json.dumps({**spec, "record": str(out / "recorded")}), "--", *flags,
            "--output-dir", str(out), *extra]


def run_one(spec: dict, out: Path, root: Path, extra: list[str], flags: list[str] = FLAGS,
            fail: bool = False) -> subprocess.CompletedProcess:
    """One more run of the driver (e.g. a --resume), alone; it must succeed, or with `fail` fail
    (accelerate launch exits 1 whatever the recipe's own code)."""
    home = root / "home"
    home.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(_command(spec, out, extra, flags), cwd=REPO, capture_output=True, text=True,
                          env=launch_env(home, ADAPTIVE_CACHE=str(home / "cache")), timeout=600)
    (root / "run.log").write_text(done.stdout + done.stderr)
    assert (done.returncode != 0) == fail, (done.stdout + done.stderr)[-3000:]
    return done


def start_fault_runs(root: Path) -> dict[str, Path]:
    return start_runs(root, SPECS, FLAGS)


def start_runs(root: Path, specs: dict[str, dict], flags: list[str]) -> dict[str, Path]:
    """Start one driver run per spec together (each single-threaded), wait for all; their folders."""
    procs = {}
    for name, spec in specs.items():
        home = root / f"home_{name}"  # own caches: the two runs fill them at the same time
        home.mkdir(parents=True)
        out = root / name
        log = open(root / f"{name}.log", "w")
        procs[name] = (subprocess.Popen(_command(spec, out, flags=flags), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
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
