"""`adaptive fit`: does this training run fit, with which DeepSpeed settings, how fast, at what cost."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from adaptive.config import FIT, RunConfig
from adaptive.config.commandline import with_run_options
from adaptive.plan import fit as plan_fit
from adaptive.plan.request import request_from_config

Json = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]


@with_run_options(FIT)
def fit(
    config: RunConfig,
    calibrate: Annotated[Optional[str], typer.Option(
        help="Plan with measured figures: a calibration FILE (`adaptive measure --save-calibration`) or a run "
             "folder with metrics.jsonl (measured peak and tokens/s).")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Write ds_config.json, accelerate_config.yaml, plan.json here.")] = None,
    json_output: Json = False,
) -> None:
    """Plan a DeepSpeed training run: ZeRO, offload, micro-batch, accumulation, checkpointing, cost."""
    plan = plan_fit(request_from_config(config, calibrate=calibrate))
    files = None
    if out:
        from adaptive.plan.ds_config.emit import write_plan_files  # the writers and json only where asked for

        files = write_plan_files(plan, out)
    if json_output:
        import json

        from adaptive.plan.ds_config.emit import plan_dict

        print(json.dumps(plan_dict(plan), indent=2))
    else:
        from cli import render  # rich is imported only for tables; --json does not need it

        render.plan(plan, files)
    if not plan.fits:
        raise typer.Exit(1)
