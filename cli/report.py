"""`adaptive report RUN_DIR`: one PNG of a run (loss, throughput, memory; expert load, MaxVio, drops, MoD skip and the
orchestrator's decisions where the run has them) and a short summary table (wall time, tokens/s, peak memory, loss,
...), from its metrics.jsonl and events.jsonl."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

RunDir = Annotated[Path, typer.Argument(help="A run's --output-dir (holds metrics.jsonl, events.jsonl).")]
Out = Annotated[Optional[Path], typer.Option("--out", "-o",
                                             help="Where to write the PNG (default RUN_DIR/report.png).")]


def report(run_dir: RunDir, out: Out = None) -> None:
    """Draw a training run and summarise it: curves, expert load per layer, the orchestrator's decisions."""
    from adaptive.extras import require

    require("adaptive report")
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from adaptive.orchestrator.report import write_report  # matplotlib is imported inside, on use
    from adaptive.train.reporting.summary import MEMORY_LABELS, duration, gib

    path, s, _ = write_report(run_dir, out)
    if s["skipped_lines"]:
        typer.echo(f"warning: skipped {s['skipped_lines']} line(s) of {run_dir}/metrics.jsonl or events.jsonl that are "
                   "not JSON records of the expected shape", err=True)
    console = Console()
    table = Table(title=f"Run {s['run_dir']}" + (f" ({s['model']})" if s["model"] else ""), box=box.SIMPLE_HEAD,
                  show_header=False)
    table.add_column("what")
    table.add_column("value")

    def num(value, fmt="{:.4f}"):
        return "-" if value is None else fmt.format(value)

    table.add_row("steps", f"{s['steps']}" + ("" if s["finished"] else " (not finished)"))
    if s["tokens_seen"] is not None:
        table.add_row("tokens", f"{s['tokens_seen']:,}")
    if s["wall_seconds"] is not None:
        several = (s["launches"] or 1) > 1
        table.add_row("wall time", duration(s["wall_seconds"]) + (f" (last of {s['launches']} launches; all launches' "
                                                                  f"steps {duration(s['train_seconds_total'])})"
                                                                  if several else ""))
    elif s["train_seconds_total"] is not None:
        table.add_row("training steps' time", duration(s["train_seconds_total"]) + " (not finished: no wall time)")
    if s["tokens_per_s"] is not None:
        mfu = f", MFU {100 * s['mfu']:.1f}%" if s["mfu"] is not None else ""
        table.add_row("tokens/s", f"{s['tokens_per_s']:,.0f} ({s['tokens_per_s_basis']}){mfu}")
    if s["peak_memory_bytes"] is not None:
        table.add_row("peak memory", f"{gib(s['peak_memory_bytes'])} {MEMORY_LABELS.get(s['peak_memory_kind'], '')}")
    table.add_row("loss", f"{num(s['loss_first'])} -> {num(s['loss_last'])} (ppl {num(s['ppl_last'], '{:.2f}')})")
    table.add_row("eval loss", num(s["eval_loss"]))
    if s["max_vio_last"] is not None:
        table.add_row("MaxVio (worst layer)",
                      f"{num(s['max_vio_first'], '{:.3f}')} -> {num(s['max_vio_last'], '{:.3f}')}")
        table.add_row("dropped fraction", num(s["dropped_last"], "{:.4f}"))
    if s["mod_skip_last"] is not None:
        table.add_row("MoD skip rate", num(s["mod_skip_last"], "{:.3f}"))
    table.add_row("skipped steps, rollbacks", f"{s['skipped_steps'] or 0}, {s['rollbacks']}")
    for label in s["restarts"]:
        table.add_row("restart", label)
    for policy, actions in s["decisions"].items():
        table.add_row(f"orchestrator: {policy}", ", ".join(f"{a} x{n}" for a, n in actions.items()))
    state = s["orchestrator"]
    if state and not state.get("enabled"):
        table.add_row("orchestrator", f"off (--orchestrator {state.get('requested')}; {state.get('reason')})")
    elif not s["decisions"]:
        table.add_row("orchestrator", "on, no decisions recorded")
    if "ep_recommendation" in s:
        rec = s["ep_recommendation"]
        table.add_row("next launch", f"ep_size {rec['ep_size']}: {rec['reason']}")
    console.print(table)
    console.print(f"Wrote {path}", soft_wrap=True)  # a path stays one line, whole, to copy
