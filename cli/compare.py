"""`adaptive compare`: plans for every model x arch x GPU, side by side."""

from __future__ import annotations

import csv
import json
import sys
from typing import Annotated, Optional

import typer

from adaptive.config.commandline import with_run_options
from adaptive.config.run import COMPARE, RunConfig
from adaptive.plan.compare import compare as compare_plans
from adaptive.plan.compare import row_dict


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _why_not(d: dict) -> str:
    """The row's reason, short enough for a table cell (the full sentence is `why_not_detail` in --json/--csv)."""
    if d["why_not"] is None:
        return ""
    if d["fits_gpu"]:
        return f"host RAM {d['host_bytes'] / 2**30:.0f}/{d['host_capacity_bytes'] / 2**30:.0f}G"
    return "GPU" + (" (pinned)" if d["why_not"] == "pinned" else "")


@with_run_options(COMPARE)
def compare(
    config: RunConfig,
    model: Annotated[str, typer.Option("--model", "-m", help="Comma-separated presets or config paths.")] = "b1,b7",
    arch: Annotated[Optional[str], typer.Option(
        help="Comma-separated archs (default: dense,moe,mod,hybrid; a fine-tune: the checkpoint's own).")] = None,
    gpu: Annotated[str, typer.Option("--gpu", "-g", help="Comma-separated GPUs.")] = "t4-16gb,rtx4090-24gb,a100-40gb",
    json_output: Annotated[bool, typer.Option("--json", help="Print a JSON list.")] = False,
    csv_output: Annotated[bool, typer.Option("--csv", help="Print CSV.")] = False,
) -> None:
    """Compare model x arch x GPU: fits, plan, peak memory, tokens/s, hours, cost, cost per 1B tokens."""
    hw, tokens, ft = config.hardware, config.schedule.tokens, config.finetune
    archs = _split(arch) if arch else [None] if ft.finetune else ["dense", "moe", "mod", "hybrid"]
    rows = compare_plans(_split(model), archs, _split(gpu), gpus=hw.gpus or 1, nodes=hw.nodes or 1,
                         seq_len=config.data.seq_len or 2048, tokens=tokens, loss_law=config.quality.loss_law,
                         dataset_tokens=config.quality.dataset_tokens, finetune=ft.finetune, lora_rank=ft.lora_rank,
                         lora_alpha=ft.lora_alpha, lora_targets=ft.lora_targets, lora_dropout=ft.lora_dropout,
                         epochs=ft.epochs)
    dicts = [row_dict(r) for r in rows]
    if json_output:
        print(json.dumps(dicts, indent=2))
        return
    if csv_output:
        w = csv.DictWriter(sys.stdout, fieldnames=list(dicts[0]))
        w.writeheader()
        w.writerows(dicts)
        return
    from rich import box
    from rich.table import Table

    from cli.render import console, duration, gib, human

    t = Table(title="Comparison (estimated; each plan as `adaptive fit` would choose it)", box=box.SIMPLE_HEAD,
              collapse_padding=True)
    numbers = ("peak", "tokens/s", "time", "cost", "$/1B tok", "loss")
    for col in ("model", "arch", "gpu", "fits", "plan", "peak", "tokens/s", "time", "cost", "$/1B tok", "loss", "best"):
        t.add_column(col, justify="right" if col in numbers else "left", no_wrap=col in ("fits", "plan"))
    for d in dicts:
        off = "" if d["offload"] == "none" else f" off:{d['offload']}"
        plan = (f"Z{d['zero_stage']}{off} mb{d['micro_batch_size']}x{d['gradient_accumulation_steps']}"
                f"{' ckpt' if d['gradient_checkpointing'] else ''} s{d['seq_len']}"
                f"{' tp' + str(d['tp_size']) if d['tp_size'] > 1 else ''}{' sp' + str(d['sp_size']) if d['sp_size'] > 1 else ''}")
        best = " ".join(n for n, k in (("loss", "best_quality"), ("cheapest", "cheapest"), ("speed", "best_speed"),
                                       ("loss (tie)", "ties_best_quality"), ("$/token", "best_cost"),
                                       ("loss/$", "best_loss_per_dollar")) if d[k])
        t.add_row(d["model"], d["arch"], f"{d['num_gpus']}x{d['gpu']}", "yes" if d["fits"] else f"[red]no[/red]: {_why_not(d)}",
                  plan, gib(d["peak_gpu_bytes"]), human(d["tokens_per_second"]),
                  duration(d["train_hours"]) if d["fits"] else "-", f"${d['cost_usd']:,.0f}" if d["fits"] else "-",
                  f"${d['cost_per_1b_tokens_usd']:,.2f}" if d["fits"] else "-",
                  "-" if d["predicted_loss"] is None else f"{d['predicted_loss']:.3f}", best)
    console.print(t)
    for d in dicts:
        if d["quality_tie"]:
            console.print(f"loss (tie): {d['quality_tie']}; the law cannot say which trains the lower loss.",
                          soft_wrap=True)
    if not all(d["fits"] for d in dicts):
        console.print("no: GPU = even the smallest peak exceeds the GPU's memory; no: host RAM = it fits the GPU only "
                      "with CPU offload, which needs more host RAM per node than it has (needed/available; --json and "
                      "--csv say it in why_not, why_not_detail).")
    laws = sorted({d["loss_law"] for d in dicts if d["loss_law"]}) or ["none: a fine-tune predicts no loss"]
    budget = "given" if tokens else ("--dataset-tokens x --epochs" if ft.finetune else
                                     "20 x active params per model (Chinchilla)")
    console.print(f"Token budget: {budget}. loss = "
                  f"predicted final loss ({'; '.join(laws)}; `adaptive fit` shows its band and source). best: loss = "
                  "lowest predicted loss; cheapest = lowest cost of the run; speed = most tokens/s; $/token = lowest $ "
                  "per 1B tokens; loss/$ = most loss reduction per extra dollar over the cheapest run. Each among "
                  "the plans that fit.", soft_wrap=True)
