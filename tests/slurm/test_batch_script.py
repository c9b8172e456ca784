"""The Slurm batch script without a cluster: its time limit and signal from the plan, bad input refused in one
line with nothing written (hostile names, a path an #SBATCH line cannot hold, --submit without sbatch, a --time
shorter than one checkpoint interval), and every value reaching the script's shell exactly as given."""

from __future__ import annotations

import math
import re
import subprocess

import pytest

from adaptive.errors import AdaptiveError
from adaptive.slurm.batch import (CHECKPOINT_BYTES_PER_PARAM, CHECKPOINT_WRITE_BYTES_PER_S, SIGNAL_MARGIN_S,
                                  format_time, parse_time, plan_job)
from tests.conftest import REPO_ROOT

B1_MOE = str(REPO_ROOT / "recipes" / "b1_moe.py")
GPU_RUN = [B1_MOE, "--gpu", "h100-80gb", "--gpus", "8", "--nodes", "4", "--scheduler", "slurm"]


def launch(capsys, *args: str) -> tuple[int, str, str]:
    from cli.main import run

    code = run(["launch", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("text, seconds", [
    ("90", 90 * 60), ("5:30", 5 * 60 + 30), ("1:02:03", 3723), ("2-0", 2 * 86400), ("1-12:30", 86400 + 45000),
    ("3-04:05:06", 3 * 86400 + 4 * 3600 + 5 * 60 + 6),
])
def test_slurm_time_formats(text, seconds):
    assert parse_time(text) == seconds


def test_a_time_is_written_in_whole_minutes_rounded_up():
    assert [format_time(s) for s in (1, 60, 61, 86400 + 3599)] == ["0-00:01:00", "0-00:01:00", "0-00:02:00",
                                                                   "1-01:00:00"]


def test_time_and_signal_come_from_the_plan_and_a_pin_caps_the_time():
    common = dict(nodes=2, processes=8, gpu=True, params=10**9, checkpoint_every=100, host_bytes_per_node=0,
                  process_bytes=0, data_workers=None, cpus_per_task=None)
    job = plan_job(run_s=3600.0, step_s=2.0, time_pin=None, **common)
    checkpoint_s = 10**9 * CHECKPOINT_BYTES_PER_PARAM / 2 / CHECKPOINT_WRITE_BYTES_PER_S  # 8 s per node
    assert job.signal_s == max(120, math.ceil(2.0 + checkpoint_s + SIGNAL_MARGIN_S))
    assert job.time_s == math.ceil(3600 * 1.25 + 15 * 60)
    # 8 processes per node, each 8 GiB and its 1/16 of the 16 GB checkpoint; 2 data workers + itself
    assert (job.gpus_per_node, job.cpus_per_task, job.mem_gib) == (8, 8 * 3, math.ceil(8 * (8 + 1e9 / 2**30)))
    assert plan_job(run_s=3600.0, step_s=2.0, time_pin="1:00:00", **common).time_s == 3600
    with pytest.raises(AdaptiveError, match=r"--time 5 is shorter than one checkpoint interval \(100 steps x 2.0 s"):
        plan_job(run_s=3600.0, step_s=2.0, time_pin="5", **common)  # 300 s < 200 s + the 120 s warning


@pytest.mark.parametrize("extra, line", [
    (["--job-name", "x;reboot"], "error: --job-name takes letters, digits and _.- (at most 64), got 'x;reboot'"),
    (["--partition", "gpu\n#SBATCH --uid=0"],
     "error: --partition takes comma-separated names of letters, digits and _.-, got 'gpu\\n#SBATCH --uid=0'"),
    (["--account", "$(id)"], "error: --account takes letters, digits and _.- (at most 64), got '$(id)'"),
    (["--time", "1h"], "error: --time takes a Slurm time: MINUTES, HH:MM:SS or DAYS-HH[:MM[:SS]], got '1h'"),
    # the step time is the planner's estimate: any figure, one line in this form
    (["--time", "10"], re.compile(r"error: --time 10 is shorter than one checkpoint interval \(1000 steps x [0-9.]+ s = "
                                  r"\d+ min\) and the 120 s warning: give at least --time 0-\d\d:\d\d:00 or a smaller "
                                  r"--checkpoint-every")),
    (["--submit", "--dry-run"], "error: --submit submits the job and --dry-run only writes it: give one of them"),
    (["--main-process-ip", "10.0.0.1"], "error: --scheduler slurm picks the nodes, their ranks and the main node: "
                                        "drop --hostfile, --main-process-ip and --machine-rank"),
])
def test_bad_slurm_input_is_one_line_and_writes_nothing(capsys, tmp_path, extra, line):
    run = tmp_path / "run"
    code, out, err = launch(capsys, *GPU_RUN, "--run-dir", str(run), *(["--dry-run"] if "--submit" not in extra
                                                                        else []), *extra)
    assert (code, out) == (2, "")
    assert line.fullmatch(err.strip()) if isinstance(line, re.Pattern) else err.strip() == line
    assert not run.exists()


def test_submit_without_sbatch_on_path_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch there
    code, out, err = launch(capsys, *GPU_RUN, "--run-dir", str(tmp_path / "run"), "--submit")
    assert code == 2 and out == "" and not (tmp_path / "run").exists()
    assert err.startswith("error: --submit needs Slurm's sbatch on PATH") and err.count("\n") == 1


def test_slurm_flags_without_the_scheduler_are_refused(capsys, tmp_path):
    code, out, err = launch(capsys, B1_MOE, "--gpu", "h100", "--run-dir", str(tmp_path / "run"), "--dry-run",
                            "--partition", "gpu")
    assert (code, err.strip()) == (2, "error: --partition is for a batch job: add --scheduler slurm")


def test_a_run_folder_an_sbatch_line_cannot_hold_is_refused(capsys, tmp_path):
    run = tmp_path / "my run%j"
    code, out, err = launch(capsys, *GPU_RUN, "--run-dir", str(run), "--dry-run")
    assert code == 2 and err.strip().startswith(f"error: {str(run)!r} cannot go on an #SBATCH line")
    assert not run.exists()


def test_every_value_reaches_the_scripts_shell_as_given(capsys, tmp_path):
    """The recipe's arguments are a bash array in the script: bash reads back exactly the strings given, and
    nothing in them runs."""
    run, marker = tmp_path / "run", tmp_path / "pwned"
    hostile = f"$(touch {marker})`touch {marker}`;touch {marker} 'x' \"y\""
    config = '{"guard": {"bad_steps": 2}}'
    code, _, err = launch(capsys, *GPU_RUN, "--run-dir", str(run), "--dry-run", "--orchestrator-config", config,
                          "--job-name", "moe.run-1", "--", "--tokenizer", hostile)
    assert code == 0, err
    script = (run / "job.sbatch").read_text()
    assert "#SBATCH --job-name=moe.run-1" in script.splitlines()
    lines = [line.strip() for line in script.splitlines() if line.strip().startswith("ARGS=(")]
    assert len(lines) == 1  # a requeued job runs the same arguments (its run resumes by itself: restart.py)
    for line in lines:
        done = subprocess.run(["bash", "-c", f'{line}; printf "%s\\n" "${{ARGS[@]}}"'], capture_output=True,
                              text=True, timeout=10)
        args = done.stdout.splitlines()
        assert args[args.index("--orchestrator-config") + 1] == config
        assert args[-2:] == ["--tokenizer", hostile]
    assert "--resume" not in lines[0] and "--overwrite" not in lines[0]
    assert not marker.exists()


def test_status_of_a_run_folder_without_a_job_says_so(capsys, tmp_path):
    from cli.main import run

    (tmp_path / "metrics.jsonl").write_text('{"kind": "start", "step": 0, "max_steps": 8, "resumed_from": null}\n'
                                            '{"kind": "train", "step": 4, "loss": 6.5}\n')
    assert run(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no batch job" in out and "run: step 4 of 8, loss 6.5000; latest checkpoint none" in out
    assert run(["status", str(tmp_path / "missing")]) == 2


def test_each_node_runs_accelerates_launcher_with_its_rank_and_the_main_node(capsys, tmp_path, monkeypatch):
    """The script's srun command as bash expands it on node 2 of 4, read by accelerate's own launcher: 4 machines of
    8 processes, this one rank 2, the main node's address and port, the recipe with the run's arguments."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as accelerate_launch
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    run = tmp_path / "run"
    code, _, err = launch(capsys, *GPU_RUN, "--run-dir", str(run), "--dry-run")
    assert code == 0, err
    script = (run / "job.sbatch").read_text()
    args_line = next(line for line in script.splitlines() if line.startswith("ARGS=("))
    snippet = re.search(r"bash -c ('.*?') \\\n\s+\"\$PY\" (\S+) \"\$\{ARGS\[@\]\}\" &", script)
    printer = tmp_path / "printer"
    printer.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    printer.chmod(0o755)
    done = subprocess.run(["bash", "-c", f'{args_line}; bash -c {snippet[1]} {printer} {snippet[2]} "${{ARGS[@]}}"'],
                          capture_output=True, text=True, timeout=10,
                          env={"SLURM_NODEID": "2", "MAIN_ADDR": "node-a", "MAIN_PORT": "29500", "PATH": "/usr/bin:/bin"})
    argv = done.stdout.splitlines()
    assert argv[:2] == ["-m", "accelerate.commands.launch"], done.stderr
    monkeypatch.setattr(accelerate_launch, "is_port_in_use", lambda port=None: False)
    parsed, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(argv[2:]))
    parsed.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    assert (parsed.num_machines, parsed.num_processes, parsed.machine_rank) == (4, 32, 2)
    assert (parsed.main_process_ip, parsed.main_process_port) == ("node-a", 29500)
    assert parsed.deepspeed_multinode_launcher == "standard"  # torchrun on each node, not pdsh
    prepare_deepspeed_cmd_env(parsed)
    assert (parsed.nnodes, parsed.node_rank, parsed.nproc_per_node) == ("4", 2, "8")
    assert parsed.rdzv_endpoint == "node-a:29500"  # torchrun's rendezvous on the main node
    assert parsed.training_script == str(REPO_ROOT / "recipes" / "b1_moe.py")
    recipe_args = parsed.training_script_args
    assert recipe_args[recipe_args.index("--output-dir") + 1] == str(run)
    assert not {"--scheduler", "--job-name", "--time", "--requeue", "--gpus", "--nodes"} & set(recipe_args)
