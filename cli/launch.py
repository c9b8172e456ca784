"""`adaptive launch`: plan a recipe's run, write its configs, print the launch command, run it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated, Optional

import typer

from adaptive.config import LAUNCH, RunConfig
from adaptive.config.commandline import with_run_options


@with_run_options(LAUNCH)
def launch(
    config: RunConfig,
    ctx: typer.Context,
    recipe: Annotated[Path, typer.Argument(help="A recipe, e.g. recipes/b1_mod.py (it declares its preset and arch).")],
    hostfile: Annotated[Optional[Path], typer.Option(help="DeepSpeed hostfile (`host slots=N` lines): launch all "
                                                     "nodes from here with DeepSpeed's pdsh launcher.")] = None,
    main_process_ip: Annotated[Optional[str], typer.Option(help="Main node's address (several nodes).")] = None,
    main_process_port: Annotated[int, typer.Option(help="Main node's port.", min=1, max=65535)] = 29500,
    machine_rank: Annotated[int, typer.Option(help="This node's rank (several nodes, no hostfile).")] = 0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Plan, write the configs (not over existing ones), print; "
                                                    "do not run.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> int:
    """Plan a recipe's run, write ds_config.json, accelerate_config.yaml and plan.json, print the exact
    launch command and run it (--scheduler slurm: write the batch job RUN/job.sbatch; --submit submits it).
    Run options go to the recipe; arguments after `--` go to it as they are."""
    from adaptive.launch import LaunchRequest, plan_launch, run_launch

    request = LaunchRequest(
        recipe=str(recipe), config=config, hostfile=str(hostfile) if hostfile else None,
        main_process_ip=main_process_ip, main_process_port=main_process_port, machine_rank=machine_rank,
        recipe_args=tuple(ctx.args), dry_run=dry_run,
        own_options=tuple(name for param in ctx.command.params for name in param.opts if name.startswith("--")),
    )
    planned = plan_launch(request)
    if json_output:
        print(json.dumps(planned.as_dict(), indent=2))
    else:
        _show(planned)
    if dry_run:
        return 0
    if planned.batch_script is not None:  # a Slurm job: submitted with --submit, else left for `sbatch`
        if not config.scheduler.submit:
            return 0
        from adaptive.slurm.jobs import JOB_RECORD, submit

        job_id = submit(planned.batch_script, planned.run_dir)
        print(f"submitted Slurm job {job_id} (recorded in {planned.run_dir / JOB_RECORD}; "
              f"`adaptive status {planned.run_dir}` shows it)")
        return 0
    return run_launch(planned)


def _show(planned) -> None:
    from adaptive.plan.search.answer import method_words
    from adaptive.plan.search.planner import describe

    ft = planned.plan.request.finetune
    method = f", {method_words(ft)}" if ft is not None else ""
    print(f"{planned.preset} {planned.arch}{method}: {describe(planned.plan.shown)}")
    for name, path in planned.files.items():
        print(f"{'wrote' if planned.written else 'kept'} {path}")
    print(f"launcher: {planned.launcher}")
    for command in planned.commands:
        print(shlex.join(command))
    if planned.deepspeed_command:
        print(f"(accelerate starts: {shlex.join(planned.deepspeed_command)})")
    for note in planned.notes:
        print(f"note: {note}")
