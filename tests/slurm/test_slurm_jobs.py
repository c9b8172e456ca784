"""`adaptive launch --scheduler slurm` on a real one-node Slurm cluster (tests/slurm/conftest.py): the b1 MoE
batch script read back by Slurm's own parser, a CPU run submitted with --submit that trains to its last step,
and a run stopped at its (signalled) time limit, requeued by its own script, requeued again with
`scontrol requeue`, that ends with the per-step losses of the uninterrupted run, bit for bit."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adaptive.plan import fit, make_request
from adaptive.slurm.batch import STARTUP_S, TIME_MARGIN
from tests.conftest import REPO_ROOT
from tests.train._launch import launch_env, records, train_losses

DEBUG_DENSE = str(REPO_ROOT / "recipes" / "debug_dense.py")
# two CPU processes on the node's two CPUs; tiny shapes; a record and a loss for every step
STEPS = 80
RUN_FLAGS = ["--gpus", "2", "--cpus-per-task", "2", "--seq-len", "32", "--micro-batch", "2", "--max-steps", str(STEPS),
             "--log-every", "1", "--checkpoint-every", "10", "--no-progress"]
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def adaptive(*args: str, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT, env=launch_env(home, ADAPTIVE_CACHE=str(home / "cache"), COLUMNS="200"))


def job(job_id: str) -> dict[str, str]:
    """Slurm's own view of the job (`scontrol show job`)."""
    done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return dict(re.findall(r"(\w+)=(\S*)", done.stdout))


def submit(run: Path, home: Path, *extra: str) -> str:
    done = adaptive("launch", DEBUG_DENSE, "--scheduler", "slurm", "--submit", "--run-dir", str(run), *RUN_FLAGS,
                    *extra, home=home)
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = json.loads((run / "slurm_job.json").read_text())["job_id"]
    assert f"submitted Slurm job {job_id}" in done.stdout
    return job_id


def wait_for(what, timeout: float, job_id: str, run: Path):
    """Poll every 0.1 s until what() is truthy; fail at once if the job ends first, or on timeout, with the job's
    state and its log's tail."""
    deadline = time.monotonic() + timeout
    polls = 0
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        polls += 1
        if polls % 10 == 0 and job(job_id)["JobState"] in ENDED:
            break
        time.sleep(0.1)
    logs = "".join(p.read_text()[-3000:] for p in sorted(run.glob("slurm-*")))
    state = job(job_id)
    pytest.fail(f"job {job_id} {state.get('JobState')} ({state.get('Reason')}) before the test saw what it waited for"
                f"\n{logs}")


def written(run: Path, kind: str) -> list[dict]:
    """metrics.jsonl's records of `kind` so far (none before it exists, or while a line is half written)."""
    try:
        return records(run, kind)
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def last_step(run: Path) -> int:
    return max((r["step"] for r in written(run, "train")), default=0)


def release_requeued(job_id: str, run: Path) -> None:
    """A requeued batch job waits for Slurm's credential lifetime (AuthInfo cred_expire, 120 s by default) before
    it may start again (its Reason is BeginTime); start it sooner, as an administrator can. Not in the second it
    was requeued: slurmd refuses a job credential no newer than the revoked one ("Job credential revoked")."""
    wait_for(lambda: job(job_id)["JobState"] == "PENDING", 60, job_id, run)
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, timeout=30)


# Generous: a wait ends as soon as what it waits for happens, or the job ends; on CI the job shares the 2 cores
# with the other test worker (an 80-step run took 48 s alone, over 150 s beside a fine-tune test).
WAIT_S = 600


def wait_until_ended(job_id: str, run: Path, timeout: float = WAIT_S) -> dict[str, str]:
    return wait_for(lambda: (j := job(job_id))["JobState"] in ENDED and j, timeout, job_id, run)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")


def test_the_b1_moe_batch_script_is_read_back_by_slurms_own_parser(slurm, tmp_path, home):
    run = tmp_path / "b1"
    done = adaptive("launch", str(REPO_ROOT / "recipes" / "b1_moe.py"), "--gpu", "h100-80gb", "--gpus", "8",
                    "--nodes", "4", "--scheduler", "slurm", "--dry-run", "--run-dir", str(run), home=home)
    assert done.returncode == 0, done.stderr
    script = run / "job.sbatch"
    text = script.read_text()
    plan = fit(make_request(model="b1", arch="moe", gpu="h100-80gb", gpus=8, nodes=4))
    minutes = math.ceil(math.ceil(plan.hours * 3600 * TIME_MARGIN + STARTUP_S) / 60)
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 f"#SBATCH --time={minutes // 1440}-{minutes % 1440 // 60:02d}:{minutes % 60:02d}:00"):
        assert line in text.splitlines(), line
    assert re.search(r"^srun --nodes=\"\$SLURM_JOB_NUM_NODES\" .*--ntasks-per-node=1", text, flags=re.M)
    assert '--machine_rank "$SLURM_NODEID"' in text
    assert 'MAIN_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0

    # Slurm reads every #SBATCH line of the script, and command-line options override them. The test cluster is one
    # CPU node with 2 CPUs and no GPUs: the GPUs, CPUs and memory are overridden so that only the node count
    # remains too large for it; Slurm refuses exactly that (so it read --nodes=4).
    fits_one_node = ["--gpus-per-node=0", "--cpus-per-task=1", "--mem=1G"]
    done = subprocess.run(["sbatch", "--test-only", *fits_one_node, str(script)], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode != 0 and "Requested node configuration is not available" in done.stderr, done.stderr
    # With the node count overridden too, Slurm accepts the script (a malformed line would still be refused: it
    # checks the script's own --time even when the command line gives one) and, held, shows what it read.
    done = subprocess.run(["sbatch", "--parsable", "--hold", "--nodes=1", *fits_one_node, str(script)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.strip()
    try:
        seen = job(job_id)
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
    assert seen["TimeLimit"] == f"{minutes // 1440}-{minutes % 1440 // 60:02d}:{minutes % 60:02d}:00".removeprefix(
        "0-")
    assert (seen["JobName"], seen["Requeue"], seen["StdOut"]) == ("b1", "0", str(run / f"slurm-{job_id}.out"))


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory, home):
    """The debug dense run submitted with --submit, trained to its last step as one job."""
    run = tmp_path_factory.mktemp("slurm") / "run"
    job_id = submit(run, home)
    ended = wait_until_ended(job_id, run)
    return {"run": run, "job_id": job_id, "job": ended}


@pytest.mark.slow
def test_a_submitted_cpu_run_trains_to_its_last_step_and_exports(uninterrupted, home):
    run, ended = uninterrupted["run"], uninterrupted["job"]
    assert (ended["JobState"], ended["ExitCode"]) == ("COMPLETED", "0:0"), ended
    assert sorted(train_losses(run)) == list(range(1, STEPS + 1))
    start, = records(run, "start")
    assert (start["world_size"], start["resumed_from"]) == (2, None)
    assert records(run, "end")[-1]["step"] == STEPS
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:08d}"
    # the export loads without adaptive's training code, as the run's final weights
    from safetensors.torch import load_file
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(run / "hf").model_type == "llama"
    weights = load_file(run / "hf" / "model.safetensors")
    assert weights and all(t.isfinite().all() for t in weights.values())
    status = adaptive("status", str(run), home=home)
    assert status.returncode == 0, status.stderr
    assert f"job {uninterrupted['job_id']} (slurm): COMPLETED" in status.stdout
    assert f"run: step {STEPS} of {STEPS}, loss {train_losses(run)[STEPS]:.4f}, finished" in status.stdout


@pytest.mark.slow
def test_a_requeued_run_resumes_without_resume_and_ends_with_the_same_losses(uninterrupted, tmp_path, home):
    run = tmp_path / "run"
    job_id = submit(run, home, "--requeue")
    # 1. the time limit: Slurm's `--signal=B:USR1@S` signals the batch shell; here it is sent now (`scancel --batch`
    #    sends what Slurm sends at the limit). The run checkpoints after its step and stops; the script requeues it.
    wait_for(lambda: last_step(run) >= 10, WAIT_S, job_id, run)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, timeout=30)
    release_requeued(job_id, run)
    # 2. requeued by hand mid-run (as preemption or an administrator does): Slurm terminates the job, and the
    #    requeued job resumes from the newest complete checkpoint
    second = wait_for(lambda: written(run, "start")[1:], WAIT_S, job_id, run)[0]
    resumed_at = int(Path(second["resumed_from"]).name.removeprefix("step_"))
    wait_for(lambda: last_step(run) >= resumed_at + 10, WAIT_S, job_id, run)
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
    release_requeued(job_id, run)
    ended = wait_until_ended(job_id, run)

    assert (ended["JobState"], ended["Restarts"]) == ("COMPLETED", "2"), ended
    starts = records(run, "start")
    resumed = [Path(s["resumed_from"]).name for s in starts[1:]]
    assert starts[0]["resumed_from"] is None and len(resumed) == 2, starts
    stopped_at = [int(name.removeprefix("step_")) for name in resumed]
    assert 10 <= stopped_at[0] < stopped_at[1] < STEPS, stopped_at  # both times mid-run
    log = (run / f"slurm-{job_id}.out").read_text()
    assert f"checkpointed at the time limit; requeueing job {job_id}" in log
    # every step logged once, with the uninterrupted run's loss to the last bit
    assert train_losses(run) == train_losses(uninterrupted["run"])
    assert [r["step"] for r in records(run, "train")] == list(range(1, STEPS + 1))
