"""A dead or hung rank never burns the cluster: real processes under torchrun on the CPU, real signals.

The debug dense recipe (tests/train/faults/_fault_recipe.py), 8 steps of 4 x 32 tokens per rank, a checkpoint
every 2 steps, one fault on one rank on the first start only. The uninterrupted runs (two and four processes)
are the baselines every restarted run's per-step losses must equal bitwise. The SIGSTOP run mostly waits (30 s
for the collective timeout, then torchrun's 30 s grace before it SIGKILLs a process SIGTERM cannot reach), so
it starts first, in the background, and is checked last.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.train._launch import REPO, launch_env

pytestmark = pytest.mark.slow  # torchrun runs of two and four processes

RECIPE = Path(__file__).with_name("_fault_recipe.py")
FLAGS = ["--max-steps", "8", "--log-every", "1", "--checkpoint-every", "2", "--seq-len", "32", "--no-progress"]
STOP_TIMEOUT = 30  # --collective-timeout of the SIGSTOP run
STOP_BOUND = 90  # every process has exited this long after the stop


def torchrun(nproc: int, restarts: int = 0) -> list[str]:
    # --standalone: a c10d rendezvous on a free port (restarts re-rendezvous there)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "--max-restarts", str(restarts)]


def start(root: Path, name: str, command: list[str], fault: dict | None, *flags: str) -> tuple[subprocess.Popen, Path]:
    out = root / name
    home = root / f"home-{name}"
    home.mkdir(parents=True)
    env = launch_env(home, ADAPTIVE_CACHE=str(root / "cache"), **({"FAULT": json.dumps(fault)} if fault else {}))
    log = open(root / f"{name}.log", "w")
    proc = subprocess.Popen([*command, *flags, "--output-dir", str(out)], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    proc.log_path = root / f"{name}.log"
    return proc, out


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        code = proc.wait(timeout=timeout)
    finally:
        _kill_group(proc)
    return code, proc.log_path.read_text()


def run(root: Path, name: str, nproc: int, fault: dict | None = None, restarts: int = 0, *flags: str):
    started = time.monotonic()
    proc, out = start(root, name, [*torchrun(nproc, restarts), str(RECIPE)], fault, *FLAGS, *flags)
    code, log = finish(proc)
    print(f"{name}: exit {code} in {time.monotonic() - started:.1f} s")
    return code, log, out


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGCONT)  # a stopped process takes SIGKILL, but be sure it is not left frozen
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def losses(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    assert len(train) == len(dict(train)), "each step once: a restart drops the records of the steps it redoes"
    return dict(train)


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def first_line(log: str) -> str:
    """The first line that is neither a progress log of the run nor torchrun's banner."""
    return next(line for line in log.splitlines() if line.startswith("rank "))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def stopped(root):
    """The SIGSTOP run, started before everything else; (process, run folder, its end time) once it ends."""
    mark = root / "stopped-at"
    proc, out = start(root, "sigstop", [*torchrun(2), str(RECIPE)],
                      {"rank": 1, "step": 3, "fault": "sigstop", "mark": str(mark)}, *FLAGS,
                      "--collective-timeout", str(STOP_TIMEOUT))
    ended: list[float] = []
    watcher = threading.Thread(target=lambda: (proc.wait(), ended.append(time.time())), daemon=True)
    watcher.start()
    try:
        yield proc, out, mark, ended, watcher
    finally:
        _kill_group(proc)
        heartbeat = out / "faults" / "heartbeat-rank1.json"
        if heartbeat.exists():  # never leave a stopped rank behind
            pid = json.loads(heartbeat.read_text())["pid"]
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break


@pytest.fixture(scope="module")
def baseline(root, stopped):
    code, log, out = run(root, "baseline", 2)
    assert code == 0, log[-3000:]
    return losses(out)


def test_sigkill_of_rank_1_mid_step_restarts_and_ends_with_the_uninterrupted_losses(root, baseline):
    code, log, out = run(root, "sigkill", 2, {"rank": 1, "step": 5, "fault": "sigkill"}, 1)
    assert code == 0, log[-3000:]
    assert losses(out) == baseline  # bitwise: == on the floats metrics.jsonl holds
    fault, restart = [e for e in events(out) if e["kind"] in ("fault", "restart")]
    assert (fault["kind"], fault["rank"], fault["step"], fault["restart"], fault["reported_by"]) == ("fault", 1, 5, 0, 0)
    assert fault["reason"].startswith(("killed by signal 9", "its process")), fault
    assert (restart["kind"], restart["restart"], restart["step"]) == ("restart", 1, 4)
    assert restart["checkpoint"].endswith("step_00000004")
    assert first_line(log).startswith("rank 1 failed at step 5"), log[-3000:]


def test_an_exception_on_rank_1_stops_every_rank_and_names_it(root, stopped):
    started = time.monotonic()
    mark = root / "raised-at"
    proc, out = start(root, "raise", [*torchrun(2), str(RECIPE)],
                      {"rank": 1, "step": 3, "fault": "unreadable", "mark": str(mark)}, *FLAGS,
                      "--collective-timeout", str(STOP_TIMEOUT))
    code, log = finish(proc)
    stopped_in = time.time() - float(mark.read_text())
    print(f"exception on rank 1: every process exited {stopped_in:.1f} s after it ({time.monotonic() - started:.1f} s "
          "in all)")
    assert code != 0 and stopped_in < STOP_TIMEOUT + 10
    line = first_line(log)
    assert line.startswith("rank 1 failed at step 3 (data): PermissionError: [Errno 13] Permission denied"), log[-3000:]
    assert sum(line.startswith("rank ") for line in log.splitlines()) == 1, "one line, not one per rank"
    [fault] = [e for e in events(out) if e["kind"] == "fault"]
    assert (fault["rank"], fault["step"], fault["phase"], fault["reported_by"]) == (1, 3, "data", 1)
    assert "PermissionError" in (out / "faults" / "stacks-rank1.txt").read_text()


def test_rank_1_killed_while_writing_a_checkpoint_never_completes_it_and_the_restart_resumes_the_one_before(root,
                                                                                                          stopped):
    code, log, base4 = run(root, "baseline4", 4)
    assert code == 0, log[-3000:]
    code, log, out = run(root, "in-checkpoint", 4, {"rank": 1, "step": 4, "fault": "sigkill_in_checkpoint"}, 1)
    assert code == 0, log[-3000:]
    assert losses(out) == losses(base4)
    fault, restart = [e for e in events(out) if e["kind"] in ("fault", "restart")]
    assert (fault["rank"], fault["step"], fault["phase"]) == (1, 4, "checkpoint"), fault
    # step 4 was not complete when rank 1 died (rank 1 had written its shards, nobody the manifest): the restart
    # resumed the checkpoint before it
    assert (restart["step"], Path(restart["checkpoint"]).name) == (2, "step_00000002")
    assert first_line(log).startswith("rank 1 failed at step 4 (checkpoint)"), log[-3000:]


def test_adaptive_launch_max_restarts_1_restarts_a_killed_rank_with_the_same_losses(root, baseline):
    out = root / "launch"
    home = root / "home-launch"
    home.mkdir()
    env = launch_env(home, ADAPTIVE_CACHE=str(root / "cache"), COLUMNS="200",
                     FAULT=json.dumps({"rank": 1, "step": 5, "fault": "sigkill"}))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "cli", "launch", str(RECIPE), "--gpus", "2", "--max-restarts", "1",
                           *FLAGS, "--output-dir", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    print(f"adaptive launch: exit {done.returncode} in {time.monotonic() - started:.1f} s")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "--max_restarts 1" in done.stdout
    assert losses(out) == baseline
    assert [(e["kind"], e["rank"] if e["kind"] == "fault" else e["step"]) for e in events(out)
            if e["kind"] in ("fault", "restart")] == [("fault", 1), ("restart", 4)]


def test_a_sigstopped_rank_is_named_and_every_process_exits_within_90_s(stopped):
    proc, out, mark, ended, watcher = stopped
    watcher.join(timeout=240)
    assert ended, "the SIGSTOP run did not end"
    stop = float(mark.read_text())
    print(f"SIGSTOP of rank 1: every process exited {ended[0] - stop:.1f} s after the stop")
    assert ended[0] - stop < STOP_BOUND
    pid = json.loads((out / "faults" / "heartbeat-rank1.json").read_text())["pid"]
    assert not Path(f"/proc/{pid}").exists(), "the stopped rank is gone"
    log = proc.log_path.read_text()
    line = first_line(log)
    assert line.startswith("rank 1 failed at step 3") and "not responding: no heartbeat for" in line, log[-3000:]
    assert proc.returncode != 0
    stacks = (out / "faults" / "stacks-rank0.txt").read_text()
    # the collective timeout or the watchdog (both at 30 s here) stopped rank 0; every thread's stack is there
    assert "culprit: rank 1: not responding" in stacks and stacks.count("Thread 0x") >= 2, stacks[:2000]
    [fault] = [e for e in events(out) if e["kind"] == "fault"]
    assert (fault["rank"], fault["reported_by"], fault["restart"]) == (1, 0, 0)
