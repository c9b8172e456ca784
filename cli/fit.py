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
Brief = Annotated[bool, typer.Option("--brief", help="Print only the first line: the verdict, what decided it, the "
                                                     "peak against the GPU, time and cost (the exit code as without).")]


@with_run_options(FIT)
def fit(
    config: RunConfig,
    calibrate: Annotated[Optional[str], typer.Option(
        help="Plan with measured figures: a calibration FILE (`adaptive measure --save-calibration`) or a run "
             "folder with metrics.jsonl (measured peak and tokens/s).")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Write ds_config.json, accelerate_config.yaml, plan.json here.")] = None,
    json_output: Json = False,
    brief: Brief = False,
) -> None:
    """Plan a DeepSpeed training run: ZeRO, offload, micro-batch, accumulation, checkpointing, cost, predicted loss."""
    q = config.quality
    if q.budget_usd is not None or q.budget_gpu_hours is not None or q.budget_days is not None:
        return fit_budget(config, calibrate, out, json_output, brief)
    if q.max_params is not None:
        from adaptive.errors import AdaptiveError

        raise AdaptiveError("--max-params bounds a budget search: give --budget-usd, --budget-gpu-hours or "
                            "--budget-days with it")
    plan = plan_fit(request_from_config(config, calibrate=calibrate))
    show("plan", plan, out, json_output, brief)
    if not plan.fits:
        raise typer.Exit(1)


# what fit shows, by kind: (emit's files writer, emit's JSON, render's tables)
SHOWN = {"plan": ("write_plan_files", "plan_dict", "plan"), "budget": ("write_budget_files", "budget_dict", "budget")}


def show(kind: str, result: object, out: Path | None, json_output: bool, brief: bool = False) -> None:
    """Write `result`'s files into `out`, then print it as JSON, as its first line alone (--brief) or as tables.
    emit (and json) is imported only where files or JSON are asked for, rich only for tables: a plain `fit` needs
    neither json nor the writers."""
    writer, as_dict, table = SHOWN[kind]
    files = None
    if out or json_output:
        from adaptive.plan.ds_config import emit

        files = getattr(emit, writer)(result, out) if out else None
        if json_output:
            import json

            print(json.dumps(getattr(emit, as_dict)(result), indent=2))
            return
    if brief:  # the plan's own words (search/answer.py), without rich
        from adaptive.plan.search.answer import first_line

        print(first_line(result).line)  # type: ignore[arg-type]
        return
    from cli import render

    getattr(render, table)(result, files)


def fit_budget(config: RunConfig, calibrate: str | None, out: Path | None, json_output: bool,
               brief: bool = False) -> None:
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
    show("budget", search_budget(req, budget, candidates, q.max_params), out, json_output, brief)
