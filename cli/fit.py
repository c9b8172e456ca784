"""`adaptive fit`: does this training run fit, with which DeepSpeed settings, how fast, at what cost, and what loss
it buys; with a budget, which model, arch and token count buy the lowest loss."""

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
    """Plan a DeepSpeed training run: ZeRO, offload, micro-batch, accumulation, checkpointing, cost, predicted loss."""
    q = config.quality
    if q.budget_usd is not None or q.budget_gpu_hours is not None or q.budget_days is not None:
        return fit_budget(config, calibrate, out, json_output)
    if q.max_params is not None:
        from adaptive.errors import AdaptiveError

        raise AdaptiveError("--max-params bounds a budget search: give --budget-usd, --budget-gpu-hours or "
                            "--budget-days with it")
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


def fit_budget(config: RunConfig, calibrate: str | None, out: Path | None, json_output: bool) -> None:
    """The lowest predicted loss a budget buys: over the size ladder and every arch (or the --model and --arch
    given), each planned on the given GPUs."""
    from adaptive.plan.architecture.hf_config import looks_like_path
    from adaptive.plan.architecture.presets import ARCHS
    from adaptive.plan.request import resolve_model
    from adaptive.plan.search.budget import Budget, ladder_specs, search_budget

    q, m = config.quality, config.model
    budget = Budget(usd=q.budget_usd, gpu_hours=q.budget_gpu_hours, days=q.budget_days)
    req = request_from_config(config, calibrate=calibrate)
    if m.name:  # a given model: the tokens the budget buys it (a preset as every arch, a config.json as its own)
        archs = (m.arch,) if m.arch else (req.spec.arch,) if looks_like_path(m.name) else ARCHS
        candidates = {a: [resolve_model(m.name, a, m.mod_capacity if a in ("mod", "hybrid") else None)] for a in archs}
    else:
        candidates = ladder_specs((m.arch,) if m.arch else ARCHS, req.spec.vocab_size)
    result = search_budget(req, budget, candidates, q.max_params)
    files = None
    if out:
        from adaptive.plan.ds_config.emit import write_budget_files

        files = write_budget_files(result, out)
    if json_output:
        import json

        from adaptive.plan.ds_config.emit import budget_dict

        print(json.dumps(budget_dict(result), indent=2))
    else:
        from cli import render

        render.budget(result, files)
