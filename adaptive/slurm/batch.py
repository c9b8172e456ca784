"""The Slurm batch job of a planned run: its resources and time limit from the plan, and the script.

    #SBATCH --nodes, --ntasks-per-node=1 (one launcher per node), --gpus-per-node (GPU plans),
    #SBATCH --cpus-per-task (the node's processes and their data workers), --mem (per process: an
    #SBATCH allowance, its checkpoint shard, a CPU run's training memory; and offloaded states), --time, --signal
    srun: accelerate's launcher on every node, its rank SLURM_NODEID, its main node the job's first

Time: the plan's predicted training time (or --max-steps x its step time) x TIME_MARGIN + STARTUP,
rounded up to whole minutes and capped by a --time pin. Slurm signals the batch shell (`B:USR1`)
SIGNAL seconds before the limit: one step, one checkpoint written at CHECKPOINT_WRITE_BYTES_PER_S per
node, and a margin. The shell's trap touches RUN/STOP, which the training loop already obeys: it
checkpoints after the current step and stops. With --requeue the script then requeues its own job;
a requeued job (SLURM_RESTART_COUNT > 0) runs the same command, which resumes from the run folder's
newest complete checkpoint by itself (adaptive.train.run.restart).

Everything user-given that reaches the script is either a strict pattern checked on the command line
(partition, account, QoS, job name, time: `adaptive.config.run`), a path of plain characters (the
#SBATCH output lines, which Slurm reads without a shell), or shell-quoted (`shlex.quote`). Pure.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

from adaptive.errors import AdaptiveError
from adaptive.record import record

TIME_MARGIN = 1.25  # over the plan's predicted time: the throughput estimate's error and the evals
STARTUP_S = 15 * 60  # loading the model and data, DeepSpeed's op builds, the first steps' warm-up
CHECKPOINT_BYTES_PER_PARAM = 16  # 16-bit weights (2) + fp32 master weights (4) + Adam's two moments (8), rounded up
CHECKPOINT_WRITE_BYTES_PER_S = 1e9  # per node, to a shared filesystem: a conservative figure
SIGNAL_MARGIN_S = 60  # for the launcher and the processes to exit after the checkpoint
SIGNAL_MIN_S = 120
SIGNAL_MAX_S = 65535  # what Slurm's --signal accepts
PROCESS_GIB = {"gpu": 8, "cpu": 2}  # host memory of one training process besides its data and checkpoint share
SCRIPT = "job.sbatch"
STOP_REQUEST = "STOP"  # the training loop's stop request (adaptive.train.run.loop.STOP_REQUEST)

# An #SBATCH line is read by Slurm, not a shell: a path there must be plain ('%' is Slurm's pattern character)
_SBATCH_PATH = re.compile(r"^[A-Za-z0-9_./:=,@+-]+$")
_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


@record
class JobResources:
    """What the job asks Slurm for, and why."""

    nodes: int
    gpus_per_node: int  # 0: a CPU run
    cpus_per_task: int  # one task (launcher) per node
    mem_gib: int  # per node
    time_s: int | None  # None: the partition's default (a CPU run has no predicted time)
    signal_s: int  # USR1 this long before the time limit
    why: tuple[str, ...]  # the script's comments: how time and signal were chosen


def parse_time(text: str) -> int:
    """Seconds of a Slurm time (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S: `man sbatch`, --time)."""
    match = _TIME.match(text)
    if match is None:
        raise AdaptiveError(f"--time takes a Slurm time: MINUTES, HH:MM:SS or DAYS-HH[:MM[:SS]], got {text!r}")
    days, a, b, c = match.groups()
    if days is not None:  # D-H, D-H:M, D-H:M:S
        h, m, s = int(a), int(b or 0), int(c or 0)
        return ((int(days) * 24 + h) * 60 + m) * 60 + s
    if b is None:  # M
        return int(a) * 60
    if c is None:  # M:S
        return int(a) * 60 + int(b)
    return (int(a) * 60 + int(b)) * 60 + int(c)  # H:M:S


def format_time(seconds: int) -> str:
    """D-HH:MM:SS, rounded up to a whole minute (Slurm's unit)."""
    minutes = math.ceil(seconds / 60)
    days, rest = divmod(minutes, 24 * 60)
    return f"{days}-{rest // 60:02d}:{rest % 60:02d}:00"


def _clock(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min" if seconds >= 60 \
        else f"{seconds:.1f} s"


def plan_job(*, nodes: int, processes: int, gpu: bool, run_s: float | None, step_s: float | None,
             params: int, checkpoint_every: int, host_bytes_per_node: int, process_bytes: int,
             data_workers: int | None, time_pin: str | None, cpus_per_task: int | None) -> JobResources:
    """The job's resources. `run_s`/`step_s`: the plan's predicted training time and step time (None on a CPU,
    whose speed the plan does not predict); `params`: the model's, for the checkpoint's size."""
    why = []
    checkpoint_s = params * CHECKPOINT_BYTES_PER_PARAM / nodes / CHECKPOINT_WRITE_BYTES_PER_S
    signal_s = SIGNAL_MIN_S
    if step_s is not None:
        signal_s = min(SIGNAL_MAX_S, max(SIGNAL_MIN_S, math.ceil(step_s + checkpoint_s + SIGNAL_MARGIN_S)))
        why.append(f"USR1 {signal_s} s before the limit: a step ({_clock(step_s)}), a checkpoint "
                   f"({params * CHECKPOINT_BYTES_PER_PARAM / 1e9:.0f} GB at {CHECKPOINT_WRITE_BYTES_PER_S / 1e9:g} "
                   f"GB/s per node: {_clock(checkpoint_s)}) and {SIGNAL_MARGIN_S} s to exit")
    else:
        why.append(f"USR1 {signal_s} s before the limit (a CPU run: the plan predicts no step time)")
    time_s = None
    if run_s is not None:
        time_s = math.ceil(run_s * TIME_MARGIN + STARTUP_S)
        why.append(f"time: the plan's {_clock(run_s)} of training x {TIME_MARGIN:g} + {STARTUP_S // 60} min to start")
    if time_pin is not None:
        pinned = parse_time(time_pin)
        interval_s = checkpoint_every * step_s if step_s is not None and checkpoint_every else 0.0
        if pinned < interval_s + signal_s:
            need = format_time(math.ceil(interval_s + signal_s))
            what = (f"one checkpoint interval ({checkpoint_every} steps x {_clock(step_s)} = {_clock(interval_s)}) "
                    f"and the {signal_s} s warning" if interval_s else f"the {signal_s} s warning before the limit")
            raise AdaptiveError(f"--time {time_pin} is shorter than {what}: give at least --time {need}"
                                + (" or a smaller --checkpoint-every" if interval_s else ""))
        if time_s is None or pinned < time_s:
            why.append(f"time: capped by --time {time_pin}" + (
                f" (the plan needs {format_time(time_s)}: the run checkpoints at the limit)" if time_s else ""))
            time_s = pinned
    # each process: its allowance, its share of a checkpoint (which passes through host memory when saved or
    # loaded), and on a CPU the training itself
    shard = params * CHECKPOINT_BYTES_PER_PARAM / (nodes * processes)
    per_process = PROCESS_GIB["gpu" if gpu else "cpu"] * 2**30 + shard + (0 if gpu else process_bytes)
    mem_gib = math.ceil((host_bytes_per_node + processes * per_process) / 2**30)
    workers = data_workers if data_workers is not None else (2 if gpu else 1)
    cpus = cpus_per_task or processes * (1 + workers)
    return JobResources(nodes=nodes, gpus_per_node=processes if gpu else 0, cpus_per_task=cpus, mem_gib=mem_gib,
                        time_s=time_s, signal_s=signal_s, why=tuple(why))


@record
class BatchJob:
    """Everything the script holds."""

    title: str  # the first comment line: what runs where
    job_name: str
    resources: JobResources
    run_dir: Path
    workdir: Path  # where launch ran: the run's relative paths mean the same
    python: str  # the launching process's interpreter, by absolute path
    pythonpath: str | None  # propagated when set
    accelerate_config: Path
    main_port: int
    args: tuple[str, ...]  # the recipe and its arguments (a requeued job's too: restart.py resumes it)
    max_restarts: int = 0  # accelerate's --max_restarts on each node (torchrun's elastic agent)
    cpu: bool = False  # tell DeepSpeed it runs on CPUs
    requeue: bool = False
    partition: str | None = None
    account: str | None = None
    qos: str | None = None


def check_sbatch_path(path: Path) -> None:
    if not _SBATCH_PATH.match(str(path)):
        raise AdaptiveError(f"{str(path)!r} cannot go on an #SBATCH line (allowed: letters, digits and _./:=,@+-); "
                            "choose a plain run folder path")


def _array(items: tuple[str, ...]) -> str:
    return "(" + " ".join(map(shlex.quote, items)) + ")"


def batch_script(job: BatchJob) -> str:
    """The batch script's text (a shell script: every value quoted)."""
    check_sbatch_path(job.run_dir)
    r = job.resources
    q = shlex.quote
    sbatch = [f"--job-name={job.job_name}", f"--nodes={r.nodes}", "--ntasks-per-node=1"]
    if r.gpus_per_node:
        sbatch.append(f"--gpus-per-node={r.gpus_per_node}")
    sbatch += [f"--cpus-per-task={r.cpus_per_task}", f"--mem={r.mem_gib}G"]
    if r.time_s is not None:
        sbatch.append(f"--time={format_time(r.time_s)}")
    sbatch += [f"--signal=B:USR1@{r.signal_s}", "--requeue" if job.requeue else "--no-requeue",
               "--open-mode=append",  # a requeued job's lines follow the first attempt's
               f"--output={job.run_dir}/slurm-%j.out", f"--error={job.run_dir}/slurm-%j.err"]
    for flag, value in (("partition", job.partition), ("account", job.account), ("qos", job.qos)):
        if value is not None:
            sbatch.append(f"--{flag}={value}")
    bindir = str(Path(job.python).parent)
    lines = ["#!/bin/bash", f"# {job.title}", "# Written by `adaptive launch --scheduler slurm`; submit it with "
             f"`sbatch {q(str(job.run_dir / SCRIPT))}`."]
    lines += [f"# {w}" for w in r.why]
    lines += [f"#SBATCH {s}" for s in sbatch]
    lines += ["set -uo pipefail", "",
              f"PY={q(job.python)}", f"RUN={q(str(job.run_dir))}",
              f"export PATH={q(bindir)}:\"$PATH\"  # the launching environment's tools (accelerate, ninja)"]
    if job.pythonpath:
        lines.append(f"export PYTHONPATH={q(job.pythonpath)}")
    if job.cpu:
        lines.append("export DS_ACCELERATOR=cpu")
    lines += [f"cd {q(str(job.workdir))}",
              'MAIN_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
              f"MAIN_PORT={int(job.main_port)}", "export MAIN_ADDR MAIN_PORT", "",
              "# The run's options (adaptive's run configuration). A requeued job runs them again: the run resumes",
              "# from its folder's newest complete checkpoint by itself, or starts over without one.",
              f"ARGS={_array(job.args)}", "",
              "# Slurm's USR1 before the time limit: the run checkpoints after its current step and stops. (A stop",
              "# request an earlier attempt left unread is not this one's.)",
              f"rm -f \"$RUN\"/{STOP_REQUEST}",
              "STOPPED=0",
              f"trap 'STOPPED=1; touch \"$RUN\"/{STOP_REQUEST}' USR1", "",
              "# One launcher per node: accelerate, its machine rank the node's, its main node the job's first. The",
              "# step takes the job's CPUs (and GPUs) on each node: srun (Slurm 22.05 on) does not inherit --cpus-per-task.",
              'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 '
              '--cpus-per-task="$SLURM_CPUS_PER_TASK" '
              + ('--gpus-per-node="$SLURM_GPUS_PER_NODE" ' if r.gpus_per_node else "") + '--kill-on-bad-exit=1 \\',
              "    bash -c 'exec \"$0\" -m accelerate.commands.launch --config_file \"$1\" --machine_rank "
              "\"$SLURM_NODEID\" --main_process_ip \"$MAIN_ADDR\" --main_process_port \"$MAIN_PORT\" "
              + (f"--max_restarts {int(job.max_restarts)} " if job.max_restarts else "") + "\"${@:2}\"' \\",
              f"    \"$PY\" {q(str(job.accelerate_config))} \"${{ARGS[@]}}\" &",
              "LAUNCHERS=$!",
              "while :; do",
              '    wait "$LAUNCHERS"; status=$?',
              '    kill -0 "$LAUNCHERS" 2>/dev/null || break  # else a signal ended the wait: srun runs on',
              "done"]
    if job.requeue:
        lines += ['if [ "$STOPPED" = 1 ] && [ "$status" = 0 ]; then',
                  '    echo "adaptive: checkpointed at the time limit; requeueing job $SLURM_JOB_ID"',
                  '    scontrol requeue "$SLURM_JOB_ID"',
                  "fi"]
    else:
        lines += ['if [ "$STOPPED" = 1 ] && [ "$status" = 0 ]; then',
                  '    echo "adaptive: checkpointed at the time limit; submit again with --resume to continue"',
                  "fi"]
    lines.append('exit "$status"')
    return "\n".join(lines) + "\n"


__all__ = ["BatchJob", "JobResources", "SCRIPT", "batch_script", "check_sbatch_path", "format_time", "parse_time",
           "plan_job"]
