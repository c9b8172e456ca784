"""rich rendering of plans and catalogs. No logic: everything shown comes from the plan objects."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from adaptive.plan.estimate.op_times import STACKS
from adaptive.plan.estimate.optimizers import DESCRIPTIONS, EIGHT_BIT
from adaptive.plan.hardware.gpus import format_gib, gib_figure
from adaptive.plan.search.answer import Answer, answer, budget_answer, duration, headroom_note
from adaptive.plan.search.planner import Plan

if TYPE_CHECKING:
    from adaptive.plan.search.budget import BudgetResult

GiB = 2**30
# Wide enough for the comparison table when piped; a terminal keeps its own width.
console = Console(width=None if sys.stdout.isatty() else 160)
# Highlighting only styles numbers and names, and styles are written only with a colour system (a terminal): without
# one, the output is the same without it, and ~5 ms sooner
console._highlight = console.color_system is not None

def part_label(part: str, p) -> str:
    """A memory part's row label, worded for the plan's base (NF4 or 16-bit) and optimizer (8-bit states)."""
    if part == "frozen_params":
        nf4 = p.roles is not None and p.roles.frozen_4bit
        return "frozen base weights (NF4 codes + quant state; the rest 16-bit)" if nf4 else "frozen base weights (16-bit)"
    if part == "optimizer" and p.request.optimizer in EIGHT_BIT:
        return "optimizer states (fp32 master; 8-bit m, v)"
    return PART_LABELS.get(part, part)


PART_LABELS = {
    "params": "16-bit parameters",
    "frozen_params": "frozen base weights",
    "dequantized_weight": "a 4-bit weight dequantized for its matmul",
    "paged_optimizer_states": "8-bit optimizer states, paged (managed memory: spill to host, not in the peak)",
    "grads": "gradients (16-bit + fp32)",
    "accumulated_grads": "16-bit gradients held between accumulation boundaries (ZeRO-0/1)",
    "zero3_grad_partition": "ZeRO-3 16-bit gradient partition",
    "optimizer": "optimizer states (fp32 master, m, v)",
    "zero3_live_params": "ZeRO-3 gathered layer",
    "hpz_secondary_params": "ZeRO++ hpZ secondary 16-bit copy (within the node)",
    "activations": "activations (saved for backward)",
    "logits_and_loss": "loss's fp32 log-softmax (saved)",
    "backward_transient": "backward working set (logit grads / recompute)",
    "comm_buckets": "DeepSpeed comm buckets",
    "attention_scores": "eager attention scores and probabilities (saved)",
    "optimizer_transient": "optimizer step temporaries (by implementation)",
    "step_flatten": "DeepSpeed's 16-bit gradient flatten copies (step)",
    "calibration_correction": "measured peak correction (--calibrate RUN_DIR)",
    "fragmentation": "allocator fragmentation (5%)",
    "cuda_context": "CUDA context (allowance)",
}
# When each part is alive during a step; the peak sums only parts alive at the same moment.
PART_WHEN = {
    "params": "whole step", "optimizer": "whole step", "comm_buckets": "whole step", "frozen_params": "whole step",
    "dequantized_weight": "forward and backward", "paged_optimizer_states": "outside the peak",
    "zero3_grad_partition": "whole step", "hpz_secondary_params": "whole step",
    "grads": "optimizer step", "zero3_live_params": "backward",
    "accumulated_grads": "backward",
    "activations": "backward", "logits_and_loss": "backward", "backward_transient": "backward",
    "attention_scores": "backward", "optimizer_transient": "optimizer step", "calibration_correction": "peak",
    "step_flatten": "optimizer step",
    "fragmentation": "allowance", "cuda_context": "allowance",
}


gib = format_gib  # one rounding of GiB on every screen (hardware/gpus.py)


def human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def bar(value: int, capacity: int, width: int = 30) -> Text:
    filled = min(width, round(width * value / capacity)) if capacity else 0
    return Text("█" * filled + "·" * (width - filled), style="cyan" if value <= capacity else "red")


def zeropp(s) -> str:
    """ "hpZ 8 (secondary copy within the node), qwZ int8 weights, qgZ int4 gradients" """
    on = [(f"hpZ {s.zero_hpz} (secondary copy within the node)", s.zero_hpz > 1),
          ("qwZ int8 weight gathers", s.zero_quantized_weights), ("qgZ int4 gradients", s.zero_quantized_gradients)]
    return ", ".join(k for k, used in on if used)


_MAYBE_EMOJI = re.compile(r":\S*:").search  # what every match of rich's emoji pattern contains


def _strings(renderable: object):
    """The str objects rich renders from `renderable` through markup (a Text is rendered as it is)."""
    if isinstance(renderable, str):
        yield renderable
    elif isinstance(renderable, Table):
        yield from (x for x in (renderable.title, renderable.caption) if isinstance(x, str))
        for column in renderable.columns:
            yield from (x for x in (column.header, column.footer, *column.cells) if isinstance(x, str))


def _print_all(shown: list[tuple[object, dict]]) -> None:
    """Print what plan() built. rich replaces emoji codes (":name:", no space inside) in every string it renders,
    importing its emoji table (~5 ms) for the first; where no string could hold one, replacing is turned off:
    the same bytes, sooner."""
    console._emoji = any(_MAYBE_EMOJI(s) for renderable, _ in shown for s in _strings(renderable))
    try:
        for renderable, kwargs in shown:
            console.print(renderable, **kwargs)
    finally:
        console._emoji = True


def plan(p: Plan, files: dict[str, Path] | None = None) -> None:
    shown: list[tuple[object, dict]] = []  # printed at the end, in one go (_print_all)

    def out(renderable: object, **kwargs: object) -> None:
        shown.append((renderable, kwargs))

    req, c = p.request, p.shown
    s = c.setup
    out(answer_line(answer(p)), soft_wrap=True)
    out(f"{human(p.counts.total)} params ({human(p.counts.active)} active){trainable_words(p)}, "
                  f"{'bf16' if req.gpu.bf16 else 'fp16'}, {gib(req.gpu.memory_bytes)} per GPU; "
                  f"{p.searched} configurations searched")

    out(knobs_table(p))

    cap = req.gpu.memory_bytes
    mem = Table(title=f"Predicted memory per GPU: {gib(c.memory.peak_gpu_bytes)} of {gib(cap)}",
                box=box.SIMPLE_HEAD)
    mem.add_column("part")
    mem.add_column("alive during")
    mem.add_column("GiB", justify="right")
    mem.add_column("share of GPU")
    m = c.memory
    for part, value in m.parts.items():
        if value:
            when = PART_WHEN.get(part, "")
            if part == "grads" and s.zero_stage in (1, 2) and not s.offload_optimizer:
                when = "16-bit: whole step; fp32: optimizer step"
            if part == "comm_buckets" and s.zero_stage in (1, 2):
                when = "backward (reduce buckets)"
            mem.add_row(part_label(part, p), when, gib_figure(value), bar(value, cap))
    mem.add_row(Text("peak", style="bold"), m.peak_phase.replace("_", " "), gib_figure(m.peak_gpu_bytes),
                bar(m.peak_gpu_bytes, cap))
    out(mem)
    out(f"peak = whole step {gib(m.persistent_bytes)} + max(backward {gib(m.backward_bytes)}, "
                  f"optimizer step {gib(m.step_bytes)}) + allowances"
        + (f"; headroom {req.headroom.words(req.gpu.memory_bytes)} kept free (--headroom)" if p.headroom_bytes else ""))
    if note := headroom_note(p):
        out(note, soft_wrap=True)
    if p.tight:
        out(f"[yellow]Tight:[/yellow] the peak is within {p.tight_margin:.0%} of capacity (the largest "
                      f"peak under-prediction on published runs of this stack); decided by "
                      f"{part_label(p.tight_part, p)} ({gib(m.parts[p.tight_part])})")
    if req.ds_config is not None:
        from adaptive.plan.ds_config.reader import drivers

        for part, n, why in drivers(req.ds_config, m.parts, s.zero_stage):
            out(f"{req.ds_config.path}: {part_label(part, p)} {gib(n)} <- {why}", soft_wrap=True)
        for key in req.ds_config.ignored:
            out(f"{req.ds_config.path}: not modelled: {key}", soft_wrap=True)
    if req.calibration_source:  # what --calibrate changed, in one line, then each figure with its source
        what = ", ".join(note.split(" (")[0] for note in req.calibrated)
        out(f"Calibrated with {req.calibration_source}: {what}", soft_wrap=True)
    for note in req.calibrated:
        out(f"Calibrated: {note}", soft_wrap=True)
    if c.memory.host_bytes_per_node:
        ok = "within" if c.fits_host else "[red]more than[/red]"
        out(f"Host RAM for offload: {gib(c.memory.host_bytes_per_node)} per node "
                      f"({ok} the {gib(p.host_mem_bytes)} available; --host-mem)"
            + (", pinned: DeepSpeed's swap buffers and what it keeps off the drive" if s.offload_device == "nvme" else ""))
    if c.memory.nvme_bytes_per_node:
        from adaptive.plan.estimate.memory import nvme_estimate

        nv = nvme_estimate(s)
        out(f"NVMe (ZeRO-Infinity): {gib(c.memory.nvme_bytes_per_node)} of swap files per node; per optimizer step "
            f"{nv.step.read_bytes / 1e9:,.1f} GB read and {nv.step.write_bytes / 1e9:,.1f} GB written, per micro-batch "
            f"{nv.micro_batch.read_bytes / 1e9:,.1f} GB of parameters read; at {nv.drive.read_gbps:g}/"
            f"{nv.drive.write_gbps:g} GB/s ({nv.drive.source})", soft_wrap=True)

    out(speed_table(p))
    if p.quality is not None:
        out(quality_table(p))
    elif p.quality_note:
        out(f"[bold]Quality:[/bold] {p.quality_note}.", soft_wrap=True)
        if p.hyperparams is not None:
            h = p.hyperparams
            out(f"Batch and learning rate: {human(p.global_batch_tokens)} tokens, lr {p.request.lr or h.lr:g}"
                + (" (--lr)" if p.request.lr else f" (the recipe of {h.source})"), soft_wrap=True)

    lad = Table(title="OOM playbook with our numbers (micro-batch 1)", box=box.SIMPLE_HEAD)
    lad.add_column("step")
    lad.add_column("peak", justify="right")
    lad.add_column("fits")
    for step in p.ladder:
        verdict = "yes" if step.fits else "no (host RAM)" if step.fits_gpu else "no"
        lad.add_row(step.change, gib(step.peak_gpu_bytes), Text(verdict, style="" if step.fits else "red"))
    out(lad)

    o = p.orchestrator
    out(f"Orchestrator: {'[green]on[/green]' if o.recommended else 'off'} ({o.reason}); {o.overhead}")
    if p.suggestions:
        out("[bold]What would fit:[/bold]")
        for sug in p.suggestions:
            out(f"  - {sug}")
    if files:
        out("Wrote " + ", ".join(str(f) for f in files.values()), soft_wrap=True)
    if files and not p.fits:
        out("Nothing fits, so only plan.json (the closest configuration and what would fit): no DeepSpeed "
                      "or accelerate config to launch a run that would not fit.")
    elif files:
        out(f"Launch: accelerate launch --config_file {files['accelerate_config']} recipes/<recipe>.py "
                      f"--ds-config {files['ds_config']}", soft_wrap=True)  # one line, to copy
    _print_all(shown)


def budget(result: BudgetResult, files: dict[str, Path] | None = None) -> None:
    """The best plan of each arch that the budget buys, then the winner's plan in full."""
    best = result.best
    req = best.request
    console.print(answer_line(budget_answer(result)), soft_wrap=True)
    t = Table(title=f"What {result.budget.describe()} buys on {req.world_size} x {req.gpu.name} "
                    f"({duration(result.hours)} of training; lowest predicted loss first)", box=box.SIMPLE_HEAD)
    for col in ("arch", "model", "params", "active", "tokens", "tok/param", "tokens/s", "time", "cost", "loss (band)"):
        t.add_column(col, justify="left" if col in ("arch", "model") else "right")
    for p in result.by_arch:
        lo, hi = p.quality.band
        t.add_row(p.request.spec.arch, p.request.spec.name, human(p.counts.total), human(p.counts.active),
                  human(p.train_tokens), f"{p.train_tokens / p.counts.active:.0f}",
                  human(p.shown.throughput.tokens_per_second), duration(p.hours), f"${p.cost:,.0f}",
                  Text(f"{p.quality.predicted_loss:.3f} ({lo:.3f}-{hi:.3f})", style="bold" if p is best else ""))
    console.print(t)
    console.print(f"Best: {best.request.spec.name} {best.request.spec.arch} ({human(best.counts.total)} params, "
                  f"width {best.request.spec.hidden_size} x {best.request.spec.num_hidden_layers} layers) on "
                  f"{human(best.train_tokens)} tokens; {result.planned} models planned on the size ladder "
                  "(adaptive/plan/architecture/ladder.py).", soft_wrap=True)
    for v in result.versus_best:
        console.print(v.words() + (": the law cannot say which buys the lower loss." if v.tie else "."),
                      soft_wrap=True)
    if result.largest_tried:
        console.print("[yellow]The winner is the largest model tried[/yellow] (the ladder's end, or --max-params): "
                      "a larger one might buy a lower loss.", soft_wrap=True)
    shown = [Text.assemble(f"{best.request.spec.name} {best.request.spec.arch} on {req.world_size} x {req.gpu.name}: ",
                           Text("FITS", style="bold green"), f" (peak {gib(best.shown.memory.peak_gpu_bytes)} of "
                           f"{gib(req.gpu.memory_bytes)}; `adaptive fit --model` on its config.json shows the memory "
                           "part by part)"), knobs_table(best), speed_table(best), quality_table(best)]
    for renderable in shown:
        console.print(renderable)
    if files:
        console.print("Wrote " + ", ".join(str(f) for f in files.values()), soft_wrap=True)
        h = best.hyperparams
        lr = f" --lr {best.request.lr or h.lr:.2g}" if h else ""
        console.print(f"Train it: accelerate launch --config_file {files['accelerate_config']} "
                      f"recipes/b1_{best.request.spec.arch}.py --model {files['model_config']} --tokens "
                      f"{best.train_tokens:.4g}{lr} --ds-config {files['ds_config']}", soft_wrap=True)


def answer_line(a: Answer) -> Text:
    """The plan's first line (search/answer.py), its verdict in colour."""
    return Text.assemble(f"{a.title}: ", Text(a.verdict, style="bold green" if a.fits else "bold red"), f": {a.reason}")


def trainable_words(p: Plan) -> str:
    """ "; 42M trainable (0.52%), 8.0B frozen (6.98B in NF4)" where a fine-tune freezes its base."""
    r = p.roles
    if r is None or not r.frozen:
        return ""
    nf4 = f", {human(r.frozen_4bit)} in NF4" if r.frozen_4bit else ""
    if r.frozen_4bit and p.request.spec.is_moe:  # transformers 5 holds experts as 3D tensors, not nn.Linear
        nf4 += " (the experts stay 16-bit: bitsandbytes quantizes nn.Linear layers only)"
    return f"; {human(r.trainable)} trainable ({r.trainable / r.total:.2%}), {human(r.frozen)} frozen{nf4}"


def knobs_table(p: Plan) -> Table:
    """The DeepSpeed knobs of the plan (or of the closest configuration)."""
    req, c = p.request, p.shown
    s, spec = c.setup, req.spec
    knobs = Table(title="Plan" if p.fits else "Closest configuration", box=box.SIMPLE_HEAD, show_header=False)
    knobs.add_column(style="bold")
    knobs.add_column()
    micro_label = "micro-batch per GPU" if s.dp_size == req.world_size else "micro-batch per replica"
    offload = "optimizer + params" if s.offload_params else "optimizer" if s.offload_optimizer else "none"
    if s.offload_device == "nvme":
        offload += f" on NVMe ({req.nvme_path or 'a drive of yours: --nvme-path'})"
    for k, v in (("ZeRO stage", s.zero_stage), ("CPU offload" if s.offload_device == "cpu" else "offload", offload),
                 (micro_label, s.micro_batch_size),
                 ("gradient accumulation", c.grad_accum),
                 ("global batch", f"{human(s.seq_len * s.micro_batch_size * c.grad_accum * s.dp_size)} tokens"),
                 ("sequence length", s.seq_len), ("activation checkpointing", checkpointing_words(s)),
                 ("expert-parallel size", s.ep_size if spec.is_moe else "-")):
        knobs.add_row(k, str(v))
    # shown only where used, so data-parallel plans read as before
    bubble = c.throughput.pipeline_bubble_fraction
    for k, v, used in (("tensor-parallel size" + (" (in each stage)" if s.pp_size > 1 else " (AutoTP)"), s.tp_size,
                        s.tp_size > 1),
                       ("sequence-parallel size (Ulysses)", s.sp_size, s.sp_size > 1),
                       ("pipeline stages (pp)", f"{s.pp_size} ({c.grad_accum} micro-batches per step, DeepSpeed's "
                        f"non-interleaved 1F1B, bubble {bubble:.1%})", s.pp_size > 1),
                       ("data-parallel replicas", s.dp_size, s.tp_size * s.sp_size * s.pp_size > 1),
                       ("optimizer", f"{req.optimizer} ({DESCRIPTIONS[req.optimizer]})", req.optimizer != "auto"),
                       ("ZeRO++", zeropp(s), s.zero_hpz > 1 or s.zero_quantized_weights or s.zero_quantized_gradients)):
        if used:
            knobs.add_row(k, str(v))
    return knobs


def speed_table(p: Plan) -> Table:
    """Tokens/s, MFU, step time, tokens, time and cost."""
    req, c = p.request, p.shown
    s, t = c.setup, c.throughput
    speed = Table(title="Speed, time and cost (estimated)", box=box.SIMPLE_HEAD, show_header=False)
    speed.add_column(style="bold")
    speed.add_column()
    speed.add_row("tokens/s (all GPUs)", f"{t.tokens_per_second:,.0f}")
    speed.add_row("MFU", f"{t.mfu:.1%} predicted (model FLOPs over peak)")
    how = ("given (--mfu)" if req.mfu is not None else "modelled per operation"
           + (", calibrated" if req.compute_scale != 1.0 else ""))
    speed.add_row("hardware utilisation", f"{t.utilisation:.0%} of peak over the compute time, {how}")
    speed.add_row("step time", f"{t.step_seconds:.2f} s (compute {t.compute_seconds:.2f}, comm not hidden "
                  f"{t.comm_seconds:.2f} of {t.comm_total_seconds:.2f}, "
                  f"all-to-all {t.alltoall_seconds:.2f}, offload {t.offload_seconds:.2f}"
                  + (f", TP all-reduce {t.tp_allreduce_seconds:.2f}" if s.tp_size > 1 else "")
                  + (f", SP all-to-all {t.sp_alltoall_seconds:.2f}" if s.sp_size > 1 else "")
                  + (f", pipeline bubble {t.pipeline_bubble_seconds:.2f}, stage sends {t.pipeline_p2p_seconds:.2f}"
                     if s.pp_size > 1 else "") + ")")
    if t.kernels_per_step:  # the per-operation model's breakdown (none under --mfu)
        stack = STACKS[s.stack]
        speed.add_row("compute by kind", f"matmul {t.matmul_seconds:.2f}, attention {t.attention_seconds:.2f}, "
                      f"memory-bound {t.memory_bound_seconds:.2f} (optimizer step {t.optimizer_seconds:.2f}), "
                      f"launch floor {t.launch_seconds:.2f} s; {t.kernels_per_step:,.0f} kernels; "
                      f"{stack.name} stack at {stack.efficiency:.0%} of the kernels' benchmark speed")
    rule = ("" if req.train_tokens else " (--dataset-tokens x --epochs; 10M tokens, 1 epoch unless given)"
            if req.finetune else " (20 x active params)")
    speed.add_row("training tokens", f"{human(p.train_tokens)}{rule}")
    speed.add_row("time", duration(p.hours))
    speed.add_row("cost", f"${p.cost:,.2f} at ${req.gpu.price_per_hour:.2f}/GPU-hour "
                  f"(${p.cost / p.train_tokens * 1e9:,.2f} per 1B tokens)")
    return speed


def quality_table(p: Plan) -> Table:
    """The predicted final loss, its band, the law and what it assumed."""
    q = p.quality
    t = Table(title="Quality (predicted final loss)", box=box.SIMPLE_HEAD, show_header=False)
    t.add_column(style="bold")
    t.add_column()
    lo, hi = q.band
    t.add_row("loss", f"{q.predicted_loss:.3f} nats/token (band {lo:.3f}-{hi:.3f})")
    plo, phi = q.perplexity_band
    t.add_row("perplexity", f"{q.perplexity:.2f} ({plo:.2f}-{phi:.2f})")
    t.add_row("law", f"{q.law} ({q.kind})")
    t.add_row("loss measured on", q.fitted_on)
    for note in q.notes:
        t.add_row("note", note)
    h = p.hyperparams
    if h is not None:
        t.add_row("compute-optimal batch, lr", f"{human(h.global_batch_tokens)} tokens, {h.lr:.2g} "
                  f"(DeepSeek LLM 2024{', extrapolated' if h.extrapolated else ''}); this plan: "
                  f"{human(p.global_batch_tokens)} tokens" + (f", lr {p.request.lr:g} (--lr)" if p.request.lr else ""))
    t.add_row("source", q.source)
    return t


def checkpointing_words(s) -> str:
    """on (every layer), off, or the selective policy the plan chose."""
    return {"full": "on", "off": "off"}.get(s.checkpointing, f"selective ({s.checkpointing})")


def measure_report(report, files: dict | None = None) -> None:
    """Predicted vs measured, part by part."""
    s = report.setup
    console.print(f"{s.spec.name} {s.spec.arch}: micro-batch {s.micro_batch_size} x seq {s.seq_len}, "
                  f"checkpointing {checkpointing_words(s)}, ZeRO-{s.zero_stage} layout on one GPU")
    t = Table(title="Predicted (adaptive fit) vs measured (real model, fake tensors)", box=box.SIMPLE_HEAD)
    for col in ("part", "predicted GiB", "measured GiB", "error"):
        t.add_column(col, justify="left" if col == "part" else "right")
    for p in report.parts:
        style = "" if abs(p.error) <= 0.05 else "red"
        t.add_row(p.name, f"{p.predicted_bytes / GiB:,.3f}", f"{p.measured_bytes / GiB:,.3f}",
                  Text(f"{p.error:+.2%}", style=style))
    console.print(t)
    console.print(f"How: {report.measurement.method}.")
    for name, path in (files or {}).items():
        console.print(f"Wrote {name}: {path}", soft_wrap=True)
