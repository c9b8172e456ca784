"""`adaptive status RUN_DIR`: a submitted run's Slurm job (its state, time, restarts) and the run's last step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

RunDir = Annotated[Path, typer.Argument(help="A run folder (`adaptive launch --scheduler slurm --submit` records "
                                             "its job in RUN_DIR/slurm_job.json).")]


def status(run_dir: RunDir,
           json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False) -> None:
    """Show a run's batch job (Slurm's state, run time, limit, restarts) and the run's last logged step."""
    from adaptive.errors import AdaptiveError
    from adaptive.slurm.jobs import JOB_RECORD, job_state, recorded_job, run_progress

    if not run_dir.is_dir():
        raise AdaptiveError(f"{str(run_dir)!r} is not a run folder")
    job = recorded_job(run_dir)
    state = job_state(job["job_id"]) if job else None
    progress = run_progress(run_dir)
    if json_output:
        print(json.dumps({"run_dir": str(run_dir), "job": job, "state": state, "run": progress}, indent=2))
        return
    if job is None:
        print(f"no batch job: {run_dir / JOB_RECORD} does not exist (not launched with --submit)")
    else:
        parts = [f"job {job['job_id']} (slurm): {state.get('JobState', 'UNKNOWN')}"]
        if state.get("Reason") not in (None, "None"):
            parts.append(f"reason {state['Reason']}")
        if state.get("RunTime"):
            parts.append(f"ran {state['RunTime']} of {state.get('TimeLimit', '?')}")
        if state.get("Restarts") not in (None, "0"):
            parts.append(f"restarts {state['Restarts']}")
        print(", ".join(parts))
    if progress["step"] is None:
        print("run: no step logged yet")
    else:
        of = f" of {progress['max_steps']}" if progress["max_steps"] else ""
        loss = f", loss {progress['loss']:.4f}" if isinstance(progress["loss"], (int, float)) else ""
        done = ", finished" if progress["finished"] else ""
        resumed = f", resumed {progress['resumes']}x" if progress["resumes"] else ""
        print(f"run: step {progress['step']}{of}{loss}{done}{resumed}; latest checkpoint "
              f"{progress['checkpoint'] or 'none'}")
