"""`adaptive compare`: plans for every model x arch x GPU, side by side."""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from adaptive.config.commandline import with_run_options
from adaptive.config.run import COMPARE, RunConfig
from adaptive.plan.compare import compare as compare_plans
from adaptive.plan.compare import row_dict
from adaptive.plan.hardware.gpus import CATALOG
from adaptive.plan.search.answer import usd

if TYPE_CHECKING:
    from rich.table import Table


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _why_not(d: dict) -> list[str]:
    """The row's reason as a table cell's lines (the full sentence is `why_not_detail` in --json/--csv)."""
    if d["why_not"] is None:
        return []
    if d["fits_gpu"]:
        return ["host RAM", f"{d['host_bytes'] / 2**30:.0f}/{d['host_capacity_bytes'] / 2**30:.0f}G"]
    return ["GPU", "(pinned)"] if d["why_not"] == "pinned" else ["GPU"]


def _csv_cell(value: object) -> object:
    """A --json value as a plain CSV cell: yes/no, "a;b" for a list (the csv module writes None as empty)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ";".join(str(v) for v in value)
    return value


def short_gpu(name: str) -> str:
    """The shortest name `--gpu` takes for a catalog GPU ("4090" for rtx4090-24gb); any other as it is named."""
    row = CATALOG.get(name.rstrip("*"))  # "a100-40gb*": a catalog GPU with a figure overridden
    return min(row.aliases, key=len) + "*" * name.endswith("*") if row is not None and row.aliases else name


# What each best-of label means; a row's `best` cell lists its labels (the legend under the table says them).
BESTS = (("loss", "best_quality"), ("loss (tie)", "ties_best_quality"), ("cheapest", "cheapest"),
         ("speed", "best_speed"), ("$/token", "best_cost"), ("loss/$", "best_loss_per_dollar"))


CKPT = {"off": "", "full": " ckpt"}  # a selective policy shows as itself (" every:4")


def _cells(d: dict, stacked: bool, compact: bool = False) -> dict[str, list[str]]:
    """A row's cells as lines: one line each (`stacked` False), or two or more where a cell holds several parts;
    `compact`: the plan's offload on its own line, and time over cost in one column."""
    from cli.render import duration, gib, human

    off = "" if d["offload"] == "none" else f" off:{d['offload']}"
    ckpt = CKPT.get(d["checkpointing"], " " + d["checkpointing"])
    layout = (f"mb{d['micro_batch_size']}x{d['gradient_accumulation_steps']}{ckpt}"
              f" s{d['seq_len']}{' tp' + str(d['tp_size']) if d['tp_size'] > 1 else ''}"
              f"{' sp' + str(d['sp_size']) if d['sp_size'] > 1 else ''}")
    fits = ["yes"] if d["fits"] else ["no:", *_why_not(d)]  # stacked: "no:" over its reason
    gpu = f"{d['num_gpus']}x{short_gpu(d['gpu'])}"
    run = {"run": [f"{d['model']} {d['arch']}", gpu]} if stacked else {"model": [d["model"]], "arch": [d["arch"]],
                                                                        "gpu": [gpu]}
    return {
        **run,
        "fits": (fits if len(fits) > 2 else [" ".join(fits)]) if stacked else [" ".join(fits)],
        "plan": ([f"Z{d['zero_stage']}", *off.split(), layout] if compact else [f"Z{d['zero_stage']}{off}", layout]
                 if stacked else [f"Z{d['zero_stage']}{off} {layout}"]),
        "peak": [gib(d["peak_gpu_bytes"])],
        "tok/s" if stacked else "tokens/s": [human(d["tokens_per_second"])],
        **({"time, cost": [duration(d["train_hours"]), usd(d['cost_usd'])] if d["fits"] else ["-"]} if compact else
           {"time": [duration(d["train_hours"]) if d["fits"] else "-"],
            "cost": [usd(d['cost_usd']) if d["fits"] else "-"]}),
        "$/1B" if stacked else "$/1B tok": [f"${d['cost_per_1b_tokens_usd']:,.2f}" if d["fits"] else "-"],
        "loss": ["-" if d["predicted_loss"] is None else f"{d['predicted_loss']:.3f}"],
        "best": [n for n, k in BESTS if d[k]] if stacked else [", ".join(n for n, k in BESTS if d[k])],
    }


NUMBERS = ("peak", "tokens/s", "tok/s", "time", "cost", "time, cost", "$/1B tok", "$/1B", "loss")
# When the table is wider than the terminal: these go first, in this order (--json and --csv keep them)
DROPPABLE = ("$/1B", "tok/s")


def _table(dicts: list[dict], width: int) -> tuple[Table, list[str]]:
    """The widest layout that fits `width` columns without cutting a cell: one line per row; else cells stacked
    over lines; else without the DROPPABLE columns (returned); else compact; at the last, cells fold rather than
    end in "…"."""
    from rich import box
    from rich.console import Console
    from rich.measure import Measurement
    from rich.table import Table

    measure = Console(width=10_000, file=io.StringIO())
    layouts = [(False, False, ()), (True, False, ()), *((True, False, DROPPABLE[:n]) for n in range(1, len(DROPPABLE) + 1)),
               (True, True, DROPPABLE)]
    for stacked, compact, dropped in layouts:
        rows = [_cells(d, stacked, compact) for d in dicts]
        columns = [c for c in rows[0] if c not in dropped]
        t = Table(title="Comparison (estimated; each plan as `adaptive fit` would choose it)", box=box.SIMPLE_HEAD,
                  collapse_padding=True)
        for col in columns:
            t.add_column(col, justify="right" if col in NUMBERS else "left", overflow="fold")
        for cells in rows:
            t.add_row(*("\n".join(cells[c]) for c in columns), end_section=stacked)
        if Measurement.get(measure, measure.options, t).maximum <= width:
            break
    return t, list(dropped)


@with_run_options(COMPARE)
def compare(
    config: RunConfig,
    model: Annotated[str, typer.Option("--model", "-m", help="Comma-separated presets or config paths.")] = "b1,b7",
    arch: Annotated[Optional[str], typer.Option(
        help="Comma-separated archs (default: dense,moe,mod,hybrid; a fine-tune: the checkpoint's own).")] = None,
    gpu: Annotated[str, typer.Option("--gpu", "-g", help="Comma-separated GPUs.")] = "t4-16gb,rtx4090-24gb,a100-40gb",
    json_output: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
    csv_output: Annotated[bool, typer.Option("--csv", help="Print CSV: a row per plan with the --json fields, each cell "
                                                           "plain: yes/no for true/false, lo;hi for loss_band, empty "
                                                           "for none.")] = False,
) -> None:
    """Compare model x arch x GPU: fits, plan, peak memory, tokens/s, hours, cost, cost per 1B tokens."""
    hw, tokens, ft = config.hardware, config.schedule.tokens, config.finetune
    archs = _split(arch) if arch else [None] if ft.finetune else ["dense", "moe", "mod", "hybrid"]
    rows = compare_plans(_split(model), archs, _split(gpu), gpus=hw.gpus or 1, nodes=hw.nodes or 1,
                         seq_len=config.data.seq_len or 2048, tokens=tokens, loss_law=config.quality.loss_law,
                         dataset_tokens=config.quality.dataset_tokens, finetune=ft.finetune, lora_rank=ft.lora_rank,
                         lora_alpha=ft.lora_alpha, lora_targets=ft.lora_targets, lora_dropout=ft.lora_dropout,
                         epochs=ft.epochs, optimizer=config.optimizer.optimizer, offload=config.parallelism.offload,
                         nvme_path=config.parallelism.nvme_path, nvme_gbps=config.parallelism.nvme_gbps)
    dicts = [row_dict(r) for r in rows]
    if json_output:
        print(json.dumps(dicts, indent=2))
        return
    if csv_output:
        w = csv.DictWriter(sys.stdout, fieldnames=list(dicts[0]))
        w.writeheader()
        w.writerows({k: _csv_cell(v) for k, v in d.items()} for d in dicts)
        return
    from cli.render import console

    width = int(os.environ["COLUMNS"]) if os.environ.get("COLUMNS", "").isdigit() else console.width
    table, dropped = _table(dicts, width)
    console.width = width  # print(width=) would not widen it past the console's own (160 in a pipe)
    console.print(table)
    if dropped:
        console.print(f"Not shown at {width} columns: {', '.join(dropped)} (a wider terminal shows them; --json and --csv "
                      "have every figure).", soft_wrap=True)
    for tie in dict.fromkeys(d["quality_tie"] for d in dicts if d["quality_tie"]):  # one line per model, not per GPU
        console.print(f"loss (tie): {tie}; the law cannot say which trains the lower loss.", soft_wrap=True)
    if not all(d["fits"] for d in dicts):
        console.print("no: GPU = even the smallest peak exceeds the GPU's memory; no: host RAM = it fits the GPU only "
                      "with CPU offload, which needs more host RAM per node than it has (needed/available; --json and "
                      "--csv say it in why_not, why_not_detail).")
    laws = sorted({d["loss_law"] for d in dicts if d["loss_law"]})
    loss = (f"predicted final loss ({'; '.join(laws)}; `adaptive fit` shows its band and source)" if laws else
            "none: a fine-tune predicts no loss (the scaling laws describe pretraining from scratch)")
    budget = "given" if tokens else ("--dataset-tokens x --epochs" if ft.finetune else
                                     "20 x active params per model (Chinchilla)")
    console.print(f"Token budget: {budget}. loss = {loss}. best: loss = "
                  "lowest predicted loss; cheapest = lowest cost of the run; speed = most tokens/s; $/token = lowest $ "
                  "per 1B tokens; loss/$ = most loss reduction per extra dollar over the cheapest run. Each among "
                  "the plans that fit.", soft_wrap=True)
