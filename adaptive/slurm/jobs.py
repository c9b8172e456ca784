"""Submit a batch job with `sbatch`, record its id in the run folder, and read its state back.

RUN/slurm_job.json holds the job id (and the cluster, for a federated `sbatch`); `adaptive status RUN`
asks `scontrol show job` (while the controller remembers the job: MinJobAge), else `sacct` (with
accounting), and reads the run's own progress from metrics.jsonl and checkpoints/latest.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from adaptive.durable import atomic_write_text
from adaptive.errors import AdaptiveError
from adaptive.orchestrator.run_records import read_records

JOB_RECORD = "slurm_job.json"
_FIELD = re.compile(r"(\w+)=(\S*)")


def require_sbatch() -> str:
    """sbatch's path; AdaptiveError when it is not on PATH (before anything is written)."""
    found = shutil.which("sbatch")
    if found is None:
        raise AdaptiveError("--submit needs Slurm's sbatch on PATH, and there is none here; run on a login node, or "
                            "drop --submit and run `sbatch RUN/job.sbatch` there")
    return found


def submit(script: Path, run_dir: Path) -> str:
    """`sbatch --parsable SCRIPT`; records and returns the job id."""
    done = subprocess.run([require_sbatch(), "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise AdaptiveError(f"sbatch refused {script}: {why}")
    job_id, _, cluster = done.stdout.strip().partition(";")
    if not job_id.isdigit():
        raise AdaptiveError(f"sbatch printed no job id for {script}: {done.stdout.strip()[:200]!r}")
    record = {"scheduler": "slurm", "job_id": job_id, "cluster": cluster or None, "script": str(script),
              "submitted": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    atomic_write_text(Path(run_dir) / JOB_RECORD, json.dumps(record, indent=2) + "\n")
    return job_id


def recorded_job(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / JOB_RECORD
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        raise AdaptiveError(f"{path} is not the JSON `adaptive launch --submit` writes") from None
    if not isinstance(record, dict) or not str(record.get("job_id", "")).isdigit():
        raise AdaptiveError(f"{path} names no job id")
    return record


def job_state(job_id: str) -> dict[str, str]:
    """The job's state: scontrol's fields (JobState, Reason, RunTime, TimeLimit, Restarts, NodeList), else sacct's;
    {"JobState": "UNKNOWN", "Reason": why} when neither knows it."""
    if shutil.which("scontrol"):
        done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
        if done.returncode == 0 and done.stdout.strip():
            return dict(_FIELD.findall(done.stdout))
    if shutil.which("sacct"):
        done = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State,Elapsed,Timelimit,ExitCode"],
                              capture_output=True, text=True, timeout=30)
        rows = [line.split("|") for line in done.stdout.splitlines() if line.strip()]
        if done.returncode == 0 and rows and len(rows[-1]) == 4:
            state, elapsed, limit, code = rows[-1]
            return {"JobState": state.split()[0], "RunTime": elapsed, "TimeLimit": limit, "ExitCode": code}
    return {"JobState": "UNKNOWN", "Reason": "neither scontrol nor sacct knows the job (finished long ago, or "
                                             "another cluster)"}


def run_progress(run_dir: Path) -> dict[str, Any]:
    """The run's last logged step and loss, its planned steps, whether it ended, and its newest checkpoint."""
    run_dir = Path(run_dir)
    out: dict[str, Any] = {"step": None, "max_steps": None, "loss": None, "finished": False, "checkpoint": None,
                           "resumes": 0}
    metrics = run_dir / "metrics.jsonl"
    records = read_records(metrics)[0] if metrics.is_file() else []  # the report's reader: bad lines skipped
    for record in records:
        kind = record.get("kind")
        if kind == "start":
            out["max_steps"] = record.get("max_steps")
            out["resumes"] += record.get("resumed_from") is not None
        elif kind == "train":
            out["step"], out["loss"] = record.get("step"), record.get("loss")
        elif kind == "end":
            out["finished"] = True
    try:
        out["checkpoint"] = (run_dir / "checkpoints" / "latest").read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        pass
    return out


__all__ = ["JOB_RECORD", "job_state", "recorded_job", "require_sbatch", "run_progress", "submit"]
