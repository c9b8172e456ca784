"""The rules behind a bounded stop, each on its own (fast): the restart rule, the watchdog's limits and thread,
naming the rank (a zombie's signal, a gone process, a stale heartbeat, a rank's own record), what events.jsonl
keeps, the report's restart lines, and what `adaptive launch` hands the launcher."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from adaptive.train.run import faults
from adaptive.train.run_folder import checkpoint  # noqa: F401  (torch and accelerate, imported once here)
from adaptive.train.run.restart import restart_count, start_mode
from adaptive.train.run.watchdog import STALL_FLOOR_S, Progress, Watchdog, heartbeat_file


def complete_checkpoint(run, step):
    folder = run / "checkpoints" / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / "model.bin").write_bytes(b"x" * 10)
    (folder / "COMPLETE.json").write_text(json.dumps({"step": step, "files": {"model.bin": {"size": 10}}}))
    (run / "checkpoints" / "latest").write_text(folder.name + "\n")


def test_restart_count_adds_torchrun_and_slurm_counts():
    assert restart_count({}) == 0
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "0"}) == 0
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "2", "SLURM_RESTART_COUNT": "1"}) == 3
    assert restart_count({"SLURM_RESTART_COUNT": "1", "TORCHELASTIC_RESTART_COUNT": "x"}) == 1


def test_a_restart_resumes_its_newest_complete_checkpoint_or_starts_afresh_and_never_overwrites(tmp_path):
    first = start_mode(None, True, tmp_path, {})
    assert (first.resume, first.overwrite, first.check_fresh, first.restart) == (None, True, True, 0)
    fresh = start_mode(None, True, tmp_path, {"TORCHELASTIC_RESTART_COUNT": "1"})
    assert (fresh.resume, fresh.overwrite, fresh.check_fresh, fresh.restart) == (None, False, False, 1)
    (tmp_path / "checkpoints" / ".tmp-step_00000004").mkdir(parents=True)  # a write a failure cut short
    assert start_mode(None, False, tmp_path, {"SLURM_RESTART_COUNT": "1"}).resume is None
    assert start_mode("auto", False, tmp_path, {"SLURM_RESTART_COUNT": "1"}).resume is None  # resumes nothing: fresh
    complete_checkpoint(tmp_path, 2)
    mode = start_mode("/elsewhere/step_00000001", True, tmp_path, {"TORCHELASTIC_RESTART_COUNT": "1"})
    assert (mode.resume, mode.overwrite, mode.check_fresh) == ("auto", False, False)


def test_the_stall_limit_is_k_times_the_median_step_with_a_floor_and_a_hard_limit():
    progress = Progress()
    assert progress.stall_limit(600) is None, "not before the first step is done (compile, warm-up)"
    progress.durations.extend([1.0, 2.0, 9.0])
    assert progress.stall_limit(600) == STALL_FLOOR_S  # 10 x 2 s is under the floor
    progress.durations.extend([20.0, 30.0])  # median 9 s
    assert progress.stall_limit(600) == 90.0
    assert progress.stall_limit(30) == 30.0


def test_the_watchdog_fires_on_a_stalled_step_but_not_during_a_checkpoint(tmp_path):
    def watch(phase):
        progress = Progress()
        progress.durations.append(0.01)
        progress.step, progress.phase, progress.since = 3, phase, time.monotonic()
        fired = []
        dog = Watchdog(progress, tmp_path, 0, 0, hard_limit=0.3, on_stall=fired.append, interval=0.05)
        dog.start()
        time.sleep(0.6)
        dog.stop()
        dog.join()
        return fired

    assert len(watch("checkpoint")) == 0
    fired = watch("backward")
    assert len(fired) == 1 and 0.3 < fired[0] < 0.6
    beat = json.loads(heartbeat_file(tmp_path, 0).read_text())
    assert (beat["rank"], beat["pid"], beat["step"], beat["phase"]) == (0, os.getpid(), 3, "backward")


def beat(run, rank, pid, age=0.0, step=5, phase="forward", restart=0):
    path = heartbeat_file(run, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "host": socket.gethostname(), "pid": pid, "restart": restart,
                                "step": step, "phase": phase, "time": time.time() - age}))


def test_a_killed_peer_is_named_with_its_signal_while_the_kernel_holds_its_status(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    deadline = time.monotonic() + 10
    while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":  # dead, not yet reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    beat(tmp_path, 0, os.getpid())
    beat(tmp_path, 1, child.pid)
    culprit = faults.diagnose(tmp_path, rank=0, restart=0, wait=0)
    assert (culprit.rank, culprit.reason) == (1, "killed by signal 9 (SIGKILL)")
    child.wait()
    culprit = faults.diagnose(tmp_path, rank=0, restart=0, wait=0)
    assert culprit.rank == 1 and culprit.reason.startswith(f"its process {child.pid} is gone")


def test_a_silent_peer_is_named_by_its_stale_heartbeat_and_a_speaking_one_by_its_record(tmp_path):
    beat(tmp_path, 0, os.getpid())
    beat(tmp_path, 1, os.getpid(), age=31)
    beat(tmp_path, 2, os.getpid(), restart=1, age=100)  # another attempt's: not this one's business
    culprit = faults.diagnose(tmp_path, rank=0, restart=0, wait=0)
    assert (culprit.rank, culprit.reason) == (1, "not responding: no heartbeat for 31 s")
    progress = Progress()
    progress.step, progress.phase = 3, "data"
    faults.record_own_failure(tmp_path, 1, 0, progress, "OSError: disk full")
    culprit = faults.diagnose(tmp_path, rank=0, restart=0, wait=0)
    assert (culprit.rank, culprit.reason, culprit.step, culprit.phase, culprit.spoke) == \
        (1, "OSError: disk full", 3, "data", True)
    assert faults.diagnose(tmp_path, rank=0, restart=1, wait=0).reason.startswith("not responding"), \
        "a record of another attempt is not this one's"


def test_with_every_rank_alive_the_one_behind_is_named_unless_it_is_this_one(tmp_path, monkeypatch):
    monkeypatch.setattr(faults, "DIAGNOSE_WAIT_S", 0.0)
    for rank in range(3):
        beat(tmp_path, rank, os.getpid(), step=5, phase="optimizer")
    assert faults.diagnose(tmp_path, rank=0, restart=0, wait=0, here=(5, "optimizer")) is None, "all level"
    beat(tmp_path, 2, os.getpid(), step=5, phase="data")
    culprit = faults.diagnose(tmp_path, rank=0, restart=0, wait=0, here=(5, "optimizer"))
    assert (culprit.rank, culprit.reason) == (2, "behind: still in step 5 (data)")
    # rank 2's own view: it is the one behind, so its watchdog's own reason stands
    assert faults.diagnose(tmp_path, rank=2, restart=0, wait=0, here=(5, "data")) is None
    progress = Progress()
    progress.step, progress.phase = 5, "data"
    culprit = faults.stop_run(tmp_path, 2, 0, progress, waited="no progress for 61 s in data", exit_now=False)
    faults._stopping.release()
    assert (culprit.rank, culprit.reason) == (2, "no progress for 61 s in data")


def test_stop_run_writes_stacks_a_record_and_one_line_from_the_lowest_live_rank(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(faults, "DIAGNOSE_WAIT_S", 0.0)
    beat(tmp_path, 0, os.getpid())
    beat(tmp_path, 1, os.getpid(), age=40, step=4)
    beat(tmp_path, 2, os.getpid())
    progress = Progress()
    progress.step, progress.phase = 5, "optimizer"
    quiet = faults.stop_run(tmp_path, 2, 0, progress, waited="its collective in optimizer failed", exit_now=False)
    assert quiet.rank == 1 and capsys.readouterr().err == "", "rank 0 speaks, not rank 2"
    faults._stopping.release()
    culprit = faults.stop_run(tmp_path, 0, 0, progress, waited="its collective in optimizer failed", exit_now=False)
    faults._stopping.release()
    err = capsys.readouterr().err
    assert err.startswith("rank 1 failed at step 5 (optimizer): not responding: no heartbeat for 40 s (seen by "
                          "rank 0: its collective in optimizer failed)") and err.count("\n") == 1
    assert culprit.rank == 1
    [record] = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert (record["kind"], record["rank"], record["step"], record["reported_by"]) == ("fault", 1, 5, 0)
    stacks = faults.stacks_file(tmp_path, 0).read_text()
    assert stacks.startswith("rank 0 at step 5 (optimizer)") and "test_stop_run_writes_stacks" in stacks


def test_a_resume_keeps_the_fault_and_restart_records_it_would_otherwise_drop(tmp_path):
    from adaptive.orchestrator.events import EventLog

    records = [{"kind": "decision", "step": 3, "policy": "oom", "action": "halve_micro_batch"},
               {"kind": "decision", "step": 6, "policy": "guard", "action": "skip"},
               {"kind": "fault", "step": 7, "rank": 1, "reason": "killed by signal 9 (SIGKILL)", "restart": 0},
               {"kind": "restart", "step": 4, "restart": 1, "checkpoint": "step_00000004"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    EventLog().open(tmp_path, True, start_step=4, resumed_from=tmp_path / "checkpoints" / "step_00000004")
    kept = [json.loads(line)["kind"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert kept == ["decision", "fault", "restart", "resume"]
    EventLog().open(tmp_path, True, start_step=0)  # a fresh start in the folder (a restart without a checkpoint)
    kept = [json.loads(line)["kind"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert kept == ["fault", "restart"]


def test_the_report_draws_each_restart_at_the_step_it_resumed_from(tmp_path):
    from adaptive.orchestrator.report import build_figure, load_run, run_summary

    train = [{"kind": "train", "step": s, "loss": 7.0 - 0.1 * s, "ppl": 100.0} for s in range(1, 9)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    events = [{"kind": "fault", "step": 5, "rank": 1, "reason": "killed by signal 9 (SIGKILL)", "restart": 0},
              {"kind": "restart", "step": 4, "restart": 1, "checkpoint": "step_00000004"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in events))
    run = load_run(tmp_path)
    ax = next(a for a in build_figure(run).axes if a.get_title() == "Loss")
    assert [line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == ":"] == [4]
    label = "restart 1 from step 4: rank 1 killed by signal 9 (SIGKILL)"
    assert label in [t.get_text() for t in ax.texts]
    assert run_summary(run)["restarts"] == [label]


def test_the_report_keeps_the_last_record_of_a_step_written_twice(tmp_path):
    """A run that failed after its records of steps 5-6 and resumed at 4 writes 5-6 again (a resume normally
    drops the first ones; a copy of the file from before may still hold both): the redone record wins."""
    from adaptive.orchestrator.report import load_run

    rows = [(s, 7.0 - 0.1 * s) for s in range(1, 7)] + [(5, 1.5), (6, 1.6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s, "loss": v}) + "\n"
                                                    for s, v in rows))
    run = load_run(tmp_path)
    assert run.steps == [1, 2, 3, 4, 5, 6] and run.series("loss")[-2:] == [1.5, 1.6]


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_collective_timeout_that_is_not_positive_is_refused(value):
    from adaptive.config.run import RunConfig
    from adaptive.errors import AdaptiveError

    with pytest.raises(AdaptiveError, match="--collective-timeout must be positive"):
        RunConfig.from_options({"collective_timeout": float(value)})


def test_a_multi_node_dry_run_shows_the_restarts_and_the_timeout_in_every_command(tmp_path):
    import shlex

    from adaptive.config.run import RunConfig
    from adaptive.launch import LaunchRequest, plan_launch
    from tests.conftest import REPO_ROOT

    recipe = str(REPO_ROOT / "recipes" / "debug_dense.py")
    config = RunConfig().replace(gpu="a100-80gb", gpus=8, nodes=2, max_restarts=2, collective_timeout=120.0,
                                 output_dir=str(tmp_path / "a"))
    planned = plan_launch(LaunchRequest(recipe=recipe, config=config, main_process_ip="10.0.0.1", dry_run=True))
    assert len(planned.commands) == 2
    for command in planned.commands:
        assert command[4:6] == ["--max_restarts", "2"], "accelerate launch's own flag, before the recipe"
        assert command[-2:] == ["--collective-timeout", "120.0"]
    assert ("a dead or hung rank stops every node within 120 s (--collective-timeout); the run is restarted up to "
            "2 time(s), resuming its newest checkpoint") in planned.notes
    defaults = plan_launch(LaunchRequest(recipe=recipe, config=RunConfig().replace(
        gpu="a100-80gb", gpus=8, nodes=2, output_dir=str(tmp_path / "c")), dry_run=True))
    assert ("a dead or hung rank stops every node within 600 s (--collective-timeout); the run is not restarted "
            "(--max-restarts)") in defaults.notes, "the defaults are shown too, not only what was given"
    config = config.replace(output_dir=str(tmp_path / "b"))
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=8\nnode-b slots=8\n")
    planned = plan_launch(LaunchRequest(recipe=recipe, config=config, hostfile=str(hostfile), dry_run=True))
    assert "--collective-timeout 120.0" in shlex.join(planned.deepspeed_command)
    assert "--max_restarts" not in shlex.join(planned.commands[0])
    assert any("--max-restarts 2 is not applied: DeepSpeed's pdsh launcher restarts nothing" in n
               for n in planned.notes)

