"""`adaptive launch`: plan a recipe's run, write its configs, build the launch command, run it.

    adaptive launch recipes/b1_mod.py --gpu a100-80gb --gpus 8                       # one node
    adaptive launch recipes/b1_mod.py --gpu a100-80gb --gpus 8 --nodes 2 \\
        --main-process-ip 10.0.0.1 --machine-rank 0                                  # run on each node
    adaptive launch recipes/b1_mod.py --gpu a100-80gb --gpus 8 --nodes 2 --hostfile hosts   # pdsh

The preset and architecture come from the recipe's own declaration (`recipe = Recipe(model="b1",
arch="mod")`), unless --model/--arch override them; launch takes every run option a recipe takes.
The run folder gets ds_config.json, accelerate_config.yaml and plan.json (the same planner and
emitters as `adaptive fit --out`). Without --gpu it plans for this machine's GPU, or, without one, for the
CPU run the recipe makes when run directly (its ds_config.json is that run's: fp32, CPU-sized knobs).
Every command is accelerate's launcher:

* one node: `accelerate launch --config_file RUN/accelerate_config.yaml RECIPE ...`;
* several nodes without a hostfile: the same command on every node with its --machine_rank and
  the main node's address (accelerate runs torchrun there: the "standard" multi-node launcher);
* with --hostfile: DeepSpeed's launcher, which accelerate starts from the main node
  (deepspeed_multinode_launcher pdsh and deepspeed_hostfile in the accelerate config); pdsh
  starts the processes on every host of the hostfile.
* with --scheduler slurm: RUN/job.sbatch, a batch job whose `srun` starts accelerate's launcher on
  every node (`adaptive.slurm.batch`); --submit hands it to `sbatch` and records the job id.

The recipe gets the run options given to launch, `--ds-config RUN/ds_config.json --output-dir RUN`
and the knobs the DeepSpeed config cannot carry (`--gpu`, `--seq-len`, `--ep-size`,
`--checkpointing`; `--pp-size` and `--pp-partition` as given, and a pipeline the planner chose as the
config's `pipeline.stages`), so it re-derives the same
plan; anything after `--` is passed to the recipe as
is. Imports no torch.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptive.config.run import TRAIN, RunConfig, to_argv
from adaptive.durable import atomic_write_text
from adaptive.errors import AdaptiveError
from adaptive.extras import require
from adaptive.plan import Plan, fit, make_request
from adaptive.plan.ds_config.emit import accelerate_config, to_yaml, write_plan_files
from adaptive.slurm.batch import SCRIPT, BatchJob, batch_script, check_sbatch_path, plan_job

MAIN_NODE_PLACEHOLDER = "MAIN_NODE_IP"


@dataclass(frozen=True)
class LaunchRequest:
    recipe: str
    config: RunConfig = RunConfig()  # the run options, as a recipe takes them
    hostfile: str | None = None
    main_process_ip: str | None = None
    main_process_port: int = 29500
    machine_rank: int = 0
    recipe_args: tuple[str, ...] = ()
    dry_run: bool = False  # a dry run writes into an existing run folder only with --overwrite
    own_options: tuple[str, ...] = ()  # launch's own flags, for the nearest one when an option is unknown


@dataclass(frozen=True)
class Launch:
    """What `adaptive launch` prints and runs."""

    preset: str
    arch: str
    plan: Plan
    run_dir: Path
    files: dict[str, Path]
    launcher: str  # "single-node" | "multi-node (accelerate, torchrun on each node)" | "multi-node (DeepSpeed, pdsh)"
    commands: list[list[str]]  # per node, or one
    this_node: list[str]  # the command this machine runs
    deepspeed_command: list[str] | None = None  # what accelerate runs for a hostfile launch
    notes: list[str] = field(default_factory=list)
    written: bool = True  # the files were written (a dry run into an existing run folder keeps them)
    batch_script: Path | None = None  # --scheduler slurm: the job to submit (nothing runs here)

    def as_dict(self) -> dict[str, Any]:
        return {"preset": self.preset, "arch": self.arch, "run_dir": str(self.run_dir), "launcher": self.launcher,
                "files": {k: str(v) for k, v in self.files.items()}, "files_written": self.written,
                "commands": [shlex.join(c) for c in self.commands], "this_node": shlex.join(self.this_node),
                "deepspeed_command": shlex.join(self.deepspeed_command) if self.deepspeed_command else None,
                "batch_script": str(self.batch_script) if self.batch_script else None, "notes": self.notes}


# DeepSpeed's hostfile grammar (deepspeed/launcher/runner.py `_parse_hostfile`): `host slots=N` per line,
# `#` comments and blank lines skipped, a host at most once.
_HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")
# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens, 253 characters at most.
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
# What may reach the remote shell pdsh runs the recipe in: no quoting, no expansion, no separators.
_SHELL_SAFE = re.compile(r"^[A-Za-z0-9_./:=,@+%-]*$")


def check_host(name: str, what: str) -> str:
    """A host name (RFC 1123) or an IPv4/IPv6 address; AdaptiveError naming `what` otherwise."""
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    if len(name) <= 253 and all(_HOST_LABEL.match(label) for label in name.split(".")):
        return name
    raise AdaptiveError(f"{what} {name!r} is not a host name (RFC 1123: letters, digits, '-' and '.') or an IP "
                        "address")


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """DeepSpeed hostfile lines `host slots=N`, each host a valid name or address."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        raise AdaptiveError(f"hostfile {path!r} cannot be read as text") from None
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _HOSTFILE_LINE.match(line)
        if match is None:
            raise AdaptiveError(f"hostfile {path!r} line {number}: {line[:80]!r} is not `HOST slots=N` "
                                "(e.g. `node-a slots=8`)")
        host = check_host(match[1], f"hostfile {path!r} line {number}: host")
        if host in hosts:
            raise AdaptiveError(f"hostfile {path!r} lists {host} twice")
        slots = int(match[2])
        if slots < 1:
            raise AdaptiveError(f"hostfile {path!r} line {number}: slots must be >= 1, got {slots}")
        hosts[host] = slots
    if not hosts:
        raise AdaptiveError(f"hostfile {path!r} lists no hosts (`HOST slots=N` per line)")
    return list(hosts.items())


def _shell_safe(args: list[str]) -> None:
    """DeepSpeed's pdsh launcher runs the recipe's command line through a shell on every host."""
    for arg in args:
        if not _SHELL_SAFE.match(arg):
            raise AdaptiveError(f"{arg!r} cannot go to the hosts' shell through pdsh (allowed: letters, digits and "
                                "_./:=,@+%-); choose a plain path or value")


def plan_launch(req: LaunchRequest) -> Launch:
    """Plan, write the run folder's configs, and build the commands (nothing is run)."""
    from adaptive.recipe import load_recipe, orchestrator_settings
    from adaptive.train.run_folder.init_from import planned_model

    recipe = Path(req.recipe)
    config = req.config
    declared = load_recipe(recipe)
    config = declared.with_defaults(config)  # a fine-tune recipe's method, as the recipe itself applies it
    preset, arch = declared.resolve(config)
    # what the recipe will parse on every node: an option it does not take is refused here, before anything is
    # written, not after the launch
    declared.check_args([*to_argv(config, TRAIN), *req.recipe_args], "adaptive launch", req.own_options)
    orchestrator_settings(config)  # the recipe would refuse them after the launch; refuse them before
    slurm = _check_scheduler(req)
    if not req.dry_run and not slurm:  # a batch job runs on the cluster's nodes, not here
        require("adaptive launch")  # before the run folder is written
    gpus, nodes = config.hardware.gpus or 1, config.hardware.nodes or 1
    gpu = config.hardware.gpu or _detected_gpu()
    hosts = read_hostfile(req.hostfile) if req.hostfile else None
    if hosts is not None:
        if len(hosts) != nodes:
            raise AdaptiveError(f"hostfile {req.hostfile!r} lists {len(hosts)} hosts but --nodes is {nodes}")
        wrong = [h for h, slots in hosts if slots is not None and slots != gpus]
        if wrong:
            raise AdaptiveError(f"hostfile slots must equal --gpus ({gpus}); not on {', '.join(wrong)}")
    if req.main_process_ip is not None:
        check_host(req.main_process_ip, "--main-process-ip")
    if not 0 <= req.machine_rank < nodes:
        raise AdaptiveError(f"--machine-rank must be in 0..{nodes - 1}, got {req.machine_rank}")
    par = config.parallelism
    notes = []
    cpu_ds_config = None
    if gpu is None:  # no CUDA here: the run the recipe makes when run directly on this CPU
        if nodes > 1:
            raise AdaptiveError(f"no CUDA GPU found here, and a CPU run is one machine: drop --nodes {nodes}, or "
                                "pass --gpu NAME to plan for GPUs (see `adaptive gpus`)")
        from adaptive.train.run.runplan import Device, World, plan_run

        cpu_run = plan_run(config, preset, arch, World(gpus, gpus), Device("cpu", None))
        plan, request, cpu_ds_config = cpu_run.plan, cpu_run.plan.request, cpu_run.ds_config
        k = cpu_run.knobs
        length = (f"{cpu_run.epochs:g} epoch(s) over the data" if cpu_run.epochs is not None else
                  f"{cpu_run.max_steps} steps unless --max-steps")
        notes.append(f"no CUDA GPU here: {gpus} CPU process(es) train in {cpu_run.precision}, sized as a recipe run "
                     f"directly (sequence {k.seq_len}, micro-batch {k.micro_batch_size} x {k.gradient_accumulation_steps}"
                     f", {length}); the plan's GPU memory and speed do not apply")
    else:
        ft = config.finetune
        # --init-from: the checkpoint's shape; a fine-tune (as the recipe plans it, train/run/runplan.py plan_run)
        # trains the checkpoint's own arch with transformers' class, with its method, optimizer and NVMe drive
        model = planned_model(config.model.init_from, preset, arch, finetune=ft.finetune)
        request = make_request(model=model, arch=None if ft.finetune else arch, gpu=gpu,
                               kernels=None if ft.finetune else "lean", gpus=gpus, nodes=nodes,
                               seq_len=config.data.seq_len or 2048, min_seq_len=config.data.min_seq_len,
                               tokens=config.schedule.tokens, zero=par.zero, offload=par.offload,
                               micro_batch=par.micro_batch, grad_accum=par.grad_accum,
                               checkpointing=config.checkpointing.gradient_checkpointing, ep_size=par.ep_size,
                               checkpoint_policy=config.checkpointing.checkpoint_policy,
                               ds_config=par.ds_config, sp_size=par.sp_size, tp_size=par.tp_size,
                               zero_hpz=par.zero_hpz, zero_quantize=par.zero_quantize, pp_size=par.pp_size,
                               optimizer=config.optimizer.optimizer, finetune=ft.finetune, lora_rank=ft.lora_rank,
                               lora_alpha=ft.lora_alpha, lora_targets=ft.lora_targets, lora_dropout=ft.lora_dropout,
                               epochs=ft.epochs, nvme_path=par.nvme_path, nvme_gbps=par.nvme_gbps)
        plan = fit(request)
        if not req.dry_run and config.hardware.gpu and not _cuda_available():
            s0 = plan.shown.setup
            notes.append(f"no CUDA GPU here: the run trains this {request.gpu.name} plan's batches (micro-batch "
                         f"{s0.micro_batch_size} x sequence {s0.seq_len}) on the CPU; without --gpu it plans a "
                         "CPU-sized run")
    if not plan.fits:
        hint = f"; would fit: {plan.suggestions[0]}" if plan.suggestions else ""
        raise AdaptiveError(f"{preset} {arch} does not fit {request.world_size} x {request.gpu.name}{hint}")
    run_dir = Path(config.output.output_dir or f"runs/{preset}_{arch}").resolve()
    if not req.dry_run:  # the recipe would refuse too, after launch had written over the run's configs
        from adaptive.train.run.entry import check_data
        from adaptive.train.run_folder.ownership import check_fresh_start, starts_fresh

        if not slurm or Path(config.data.dataset or "").expanduser().exists():  # else it is the cluster's path
            check_data(config)

        check_fresh_start(run_dir, config.output.resume, config.output.overwrite)
        if config.output.resume and not starts_fresh(run_dir, config.output.resume):  # the recipe says so
            _require_a_checkpoint(config.output.resume, run_dir)
    files = {"ds_config": run_dir / "ds_config.json", "accelerate_config": run_dir / "accelerate_config.yaml",
             "plan": run_dir / "plan.json"}
    if slurm:
        files["batch_script"] = run_dir / SCRIPT
        check_sbatch_path(run_dir)  # before anything is written
    if hosts is not None:  # checked before anything is written
        _shell_safe([str(run_dir), str(recipe.resolve()), *to_argv(config, TRAIN), *req.recipe_args])
    # the recipe re-derives this plan: the user's options, the written DeepSpeed config, and the knobs
    # that config cannot carry (the launcher, not a flag, gives the recipe its world)
    s = plan.shown.setup
    # a DeepSpeed file of yours goes to the recipe as it is (its "auto" values are the recipe's to fill)
    handed = config.replace(ds_config=par.ds_config or str(files["ds_config"]), output_dir=str(run_dir),
                            gpu=request.gpu.name if cpu_ds_config is None else None,
                            gpus=None, nodes=None, seq_len=s.seq_len, gradient_checkpointing=s.gradient_checkpointing,
                            ep_size=s.ep_size if s.spec.is_moe else None)
    recipe_args = [str(recipe.resolve()), *to_argv(handed, TRAIN), *req.recipe_args]
    script = _batch_script(req, plan, handed, files, cpu=cpu_ds_config is not None,
                           title=f"{preset} {arch}") if slurm else None
    if slurm and _length_from_data(config, plan) and config.scheduler.time is None:
        notes.append("a fine-tune runs whole epochs of its data, which the plan does not count: the job has no time "
                     "limit of its own (the partition's applies); give --time, or --max-steps")
    keep = req.dry_run and not config.output.overwrite and any(path.exists() for path in files.values())
    if not keep:
        files = {**write_plan_files(plan, run_dir), **({"batch_script": files["batch_script"]} if slurm else {})}
        if cpu_ds_config is not None:  # what the recipe runs on this CPU (fp32, its knobs), not the GPU plan's
            atomic_write_text(files["ds_config"], json.dumps(cpu_ds_config, indent=2) + "\n")
    main_ip = req.main_process_ip or (hosts[0][0] if hosts else None)
    acc = accelerate_config(plan.shown.setup, str(files["ds_config"]))
    if nodes > 1:
        acc["main_process_ip"] = main_ip or MAIN_NODE_PLACEHOLDER
        acc["main_process_port"] = req.main_process_port
    if hosts is not None:
        acc["deepspeed_config"]["deepspeed_multinode_launcher"] = "pdsh"
        acc["deepspeed_config"]["deepspeed_hostfile"] = str(Path(req.hostfile).expanduser().resolve())
    if not keep:
        files["accelerate_config"].write_text(to_yaml(acc))
    if script is not None and not (keep and files["batch_script"].exists()):  # a new file overwrites nothing
        atomic_write_text(files["batch_script"], script)
        if keep:
            notes.append(f"wrote {files['batch_script']}: it is new, so it replaced nothing")

    base = ["accelerate", "launch", "--config_file", str(files["accelerate_config"])]
    if hosts is None and config.faults.max_restarts:  # torchrun's elastic agent restarts the worker group
        base += ["--max_restarts", str(config.faults.max_restarts)]
    elif config.faults.max_restarts:
        notes.append(f"--max-restarts {config.faults.max_restarts} is not applied: DeepSpeed's pdsh launcher restarts "
                     "nothing (a failed rank stops every process of the run); relaunch with --resume, or launch "
                     "without --hostfile (torchrun on each node restarts)")
    deepspeed_command = None
    if slurm:
        launcher = f"Slurm batch job (srun: accelerate's launcher on each of {nodes} node(s))"
        commands = [["sbatch", str(files["batch_script"])]]
        this_node = commands[0]
        notes.append("the run folder must be on a filesystem every node shares" if nodes > 1 else
                     "the job runs on the node Slurm gives it")
    elif nodes == 1:
        launcher = "single-node"
        commands = [base + recipe_args]
        this_node = commands[0]
    elif hosts is not None:
        launcher = "multi-node (DeepSpeed launcher, pdsh)"
        commands = [base + recipe_args]
        this_node = commands[0]
        deepspeed_command = ["deepspeed", "--hostfile", acc["deepspeed_config"]["deepspeed_hostfile"],
                             "--no_local_rank", "--launcher", "pdsh", "--num_gpus", str(gpus),
                             "--master_addr", acc["main_process_ip"], "--master_port", str(req.main_process_port),
                             *recipe_args]
        notes.append(f"run it on the main node ({acc['main_process_ip']}); pdsh starts every host of the hostfile")
    else:
        launcher = "multi-node (accelerate, torchrun on each node)"
        commands = [base + ["--machine_rank", str(rank), "--main_process_ip", acc["main_process_ip"],
                            "--main_process_port", str(req.main_process_port)] + recipe_args
                    for rank in range(nodes)]
        this_node = commands[req.machine_rank]
        notes.append("run each command on its node (same run folder on a shared filesystem)")
        if main_ip is None:
            notes.append(f"replace {MAIN_NODE_PLACEHOLDER} with the main node's address, or pass --main-process-ip")
    if nodes > 1:  # what a dead or hung rank costs on a cluster (faults.py, restart.py)
        faults = config.faults
        restarts = (f"restarted up to {faults.max_restarts} time(s), resuming its newest checkpoint"
                    if faults.max_restarts and hosts is None else "not restarted (--max-restarts)")
        notes.append(f"a dead or hung rank stops every node within {faults.collective_timeout:g} s "
                     f"(--collective-timeout); the run is {restarts}")
    if keep:
        notes.append(f"dry run: the configs already in {run_dir} were left as they are (--overwrite writes these)")
    return Launch(preset=preset, arch=arch, plan=plan, run_dir=run_dir, files=files, launcher=launcher,
                  written=not keep, batch_script=files.get("batch_script"),
                  commands=commands, this_node=this_node, deepspeed_command=deepspeed_command, notes=notes)


def _check_scheduler(req: LaunchRequest) -> bool:
    """--scheduler slurm and its flags, consistent (before anything is written); True for a Slurm job."""
    from adaptive.slurm.jobs import require_sbatch

    sched = req.config.scheduler
    if sched.scheduler != "slurm":
        given = [name for name, value in (("--submit", sched.submit), ("--partition", sched.partition),
                                          ("--account", sched.account), ("--qos", sched.qos),
                                          ("--job-name", sched.job_name), ("--time", sched.time),
                                          ("--requeue", sched.requeue), ("--cpus-per-task", sched.cpus_per_task))
                 if value not in (None, False)]
        if given:
            raise AdaptiveError(f"{given[0]} is for a batch job: add --scheduler slurm")
        return False
    if req.hostfile or req.main_process_ip or req.machine_rank:
        raise AdaptiveError("--scheduler slurm picks the nodes, their ranks and the main node: drop --hostfile, "
                            "--main-process-ip and --machine-rank")
    if sched.submit and req.dry_run:
        raise AdaptiveError("--submit submits the job and --dry-run only writes it: give one of them")
    if sched.submit:
        require_sbatch()
    return True


def _batch_script(req: LaunchRequest, plan: Plan, handed: RunConfig, files: dict[str, Path], cpu: bool,
                  title: str) -> str:
    """RUN/job.sbatch's text: the job's resources from the plan, and the recipe's arguments."""
    config, sched, out = req.config, req.config.scheduler, handed.output
    gpus, nodes = config.hardware.gpus or 1, config.hardware.nodes or 1
    shown = plan.shown
    step_s = None if cpu else shown.throughput.step_seconds
    run_s = None if cpu or _length_from_data(config, plan) else (
        config.schedule.max_steps * step_s if config.schedule.max_steps else plan.hours * 3600)
    resources = plan_job(nodes=nodes, processes=gpus, gpu=not cpu, run_s=run_s, step_s=step_s,
                         params=plan.counts.total, checkpoint_every=out.checkpoint_every,
                         host_bytes_per_node=0 if cpu else shown.memory.host_bytes_per_node,
                         process_bytes=shown.memory.peak_gpu_bytes, data_workers=config.data.data_workers,
                         time_pin=sched.time, cpus_per_task=sched.cpus_per_task)

    def args(run: RunConfig) -> tuple[str, ...]:
        return (str(Path(req.recipe).resolve()), *to_argv(run, TRAIN), *req.recipe_args)

    run_dir = Path(out.output_dir)
    where = f"{nodes} node(s) x {gpus} {'CPU process(es)' if cpu else plan.request.gpu.name}"
    return batch_script(BatchJob(
        title=f"{title} on {where}",
        job_name=sched.job_name or re.sub(r"[^A-Za-z0-9_.-]", "_", run_dir.name)[:64] or "adaptive",
        resources=resources, run_dir=run_dir, workdir=Path.cwd(), python=sys.executable,
        pythonpath=os.environ.get("PYTHONPATH") or None, accelerate_config=files["accelerate_config"],
        main_port=req.main_process_port, args=args(handed), cpu=cpu,
        max_restarts=config.faults.max_restarts or 0,
        requeue=sched.requeue, partition=sched.partition, account=sched.account, qos=sched.qos))


def _length_from_data(config: RunConfig, plan: Plan) -> bool:
    """A fine-tune without --max-steps or --tokens: the recipe counts its steps from its examples (--epochs of them),
    while the plan's hours are of a nominal dataset (plan/finetune/defaults.py), so they time no job."""
    return plan.request.finetune is not None and not config.schedule.max_steps and config.schedule.tokens is None


def _require_a_checkpoint(resume: str, run_dir: Path) -> None:
    """A complete checkpoint to resume from (sizes checked; the recipe verifies its digests)."""
    from adaptive.train.run_folder.checkpoint import find_checkpoint

    if find_checkpoint(resume, run_dir, digests=False) is None:
        raise AdaptiveError(f"--resume: {run_dir if resume == 'auto' else resume} holds no complete checkpoint, "
                            "so nothing was written; launch a fresh run without --resume")


def run_launch(launch: Launch) -> int:
    """Run this node's command through accelerate's launcher, in this process, and return its exit code.
    A recipe that stops on bad input has already said why in one line (and left it in ADAPTIVE_ERROR_FILE):
    that is exit code 2, without the launcher's traceback on top."""
    require("adaptive launch")  # accelerate's launcher, here and on every node
    from accelerate.commands.launch import launch_command, launch_command_parser

    from adaptive.config.commandline import ERROR_FILE_ENV
    from adaptive.engine import name_cpu_accelerator

    command = launch.this_node
    if MAIN_NODE_PLACEHOLDER in command:
        raise AdaptiveError("the main node's address is unknown: pass --main-process-ip (or --dry-run)")
    args = launch_command_parser().parse_args(command[2:])  # the printed command, minus `accelerate launch`
    fd, error_file = tempfile.mkstemp(prefix="adaptive-error-", suffix=".txt")
    os.close(fd)
    previous = os.environ.get(ERROR_FILE_ENV)
    os.environ[ERROR_FILE_ENV] = error_file
    named = name_cpu_accelerator()  # the launcher's DeepSpeed import and the recipe's: no accelerator warning
    try:
        with _LauncherLogsHeld() as held:
            try:
                launch_command(args)
            except Exception:
                if Path(error_file).read_text(encoding="utf-8").strip():
                    return 2
                held.show()
                raise
        return 0
    finally:
        Path(error_file).unlink(missing_ok=True)
        if named:
            os.environ.pop("DS_ACCELERATOR", None)
        if previous is None:
            os.environ.pop(ERROR_FILE_ENV, None)
        else:
            os.environ[ERROR_FILE_ENV] = previous


class _LauncherLogsHeld(logging.Handler):
    """Holds the log records of torch's launcher and elastic agent (their failure report) until the run ends;
    they are shown only when the recipe did not say why it failed."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.saved: dict[logging.Logger, tuple[list[logging.Handler], bool]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> _LauncherLogsHeld:
        import torch.distributed.run  # noqa: F401  (creates the launcher's and the agent's loggers)

        names = [n for n in logging.Logger.manager.loggerDict if n == "torch.distributed" or
                 n.startswith("torch.distributed.")]
        for logger in map(logging.getLogger, names):
            self.saved[logger] = logger.handlers[:], logger.propagate
            logger.handlers, logger.propagate = [self], False
        return self

    def __exit__(self, *exc: object) -> None:
        for logger, (handlers, propagate) in self.saved.items():
            logger.handlers, logger.propagate = handlers, propagate

    def show(self) -> None:
        """Show the held records, through the handlers their loggers had."""
        self.__exit__()
        for record in self.records:
            logging.getLogger(record.name).handle(record)
        self.records.clear()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _detected_gpu() -> str | None:
    """The catalog name of this machine's CUDA GPU; None without one (the run trains on the CPU)."""
    from adaptive.train.run.runplan import detect_device

    device = detect_device(None)
    return device.gpu.name if device.gpu is not None else None


__all__ = ["Launch", "LaunchRequest", "MAIN_NODE_PLACEHOLDER", "plan_launch", "read_hostfile", "run_launch"]
