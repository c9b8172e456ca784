"""`adaptive launch`: plan a recipe's run, write its configs, print the launch command, run it."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated, Optional

import typer

from cli.fit import Gpu, Gpus, Nodes


def launch(
    ctx: typer.Context,
    recipe: Annotated[Path, typer.Argument(help="A recipe, e.g. recipes/b1_mod.py (its name gives preset and arch).")],
    gpu: Gpu = None,
    gpus: Gpus = 1,
    nodes: Nodes = 1,
    hostfile: Annotated[Optional[Path], typer.Option(help="DeepSpeed hostfile (`host slots=N` lines): launch all "
                                                     "nodes from here with DeepSpeed's pdsh launcher.")] = None,
    run_dir: Annotated[Optional[Path], typer.Option(help="Run folder for configs, checkpoints, metrics "
                                                    "(default runs/PRESET_ARCH).")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Override the recipe's preset.")] = None,
    arch: Annotated[Optional[str], typer.Option(help="Override the recipe's architecture.")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Sequence length to plan (default 2048).")] = None,
    tokens: Annotated[Optional[float], typer.Option(help="Training tokens (default 20 x active params).")] = None,
    main_process_ip: Annotated[Optional[str], typer.Option(help="Main node's address (several nodes).")] = None,
    main_process_port: Annotated[int, typer.Option(help="Main node's port.")] = 29500,
    machine_rank: Annotated[int, typer.Option(help="This node's rank (several nodes, no hostfile).")] = 0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Plan, write the configs, print; do not run.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> int:
    """Plan a recipe's run, write ds_config.json, accelerate_config.yaml and plan.json, print the exact
    launch command and run it. Arguments after `--` go to the recipe."""
    from adaptive.train.launch import LaunchRequest, plan_launch, run_launch

    request = LaunchRequest(
        recipe=str(recipe), gpu=gpu, gpus=gpus, nodes=nodes, hostfile=str(hostfile) if hostfile else None,
        run_dir=str(run_dir) if run_dir else None, model=model, arch=arch, seq_len=seq_len, tokens=tokens,
        main_process_ip=main_process_ip, main_process_port=main_process_port, machine_rank=machine_rank,
        recipe_args=tuple(ctx.args),
    )
    planned = plan_launch(request)
    if json_output:
        print(json.dumps(planned.as_dict(), indent=2))
    else:
        _show(planned)
    if dry_run:
        return 0
    return run_launch(planned)


def _show(planned) -> None:
    from adaptive.plan.planner import describe

    print(f"{planned.preset} {planned.arch}: {describe(planned.plan.shown)}")
    for name, path in planned.files.items():
        print(f"wrote {path}")
    print(f"launcher: {planned.launcher}")
    for command in planned.commands:
        print(shlex.join(command))
    if planned.deepspeed_command:
        print(f"(accelerate starts: {shlex.join(planned.deepspeed_command)})")
    for note in planned.notes:
        print(f"note: {note}")
