"""Slurm: the batch job `adaptive launch --scheduler slurm` writes and submits, and its state.

- `batch`: the job's resources and time from the plan, and the batch script (pure: no I/O, no torch);
- `jobs`: `sbatch` (submit, record the job id in the run folder) and the job's state (`scontrol`, `sacct`).

A requeued job runs the same command; the run resumes by itself (adaptive.train.run.restart).
"""
