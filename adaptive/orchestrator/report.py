"""One picture of a run, from its metrics.jsonl and events.jsonl (`adaptive report RUN_DIR`).

Panels, only those the run has something for (each axes carries its title, so a test or a user can find it):

    "Loss"                           training loss (a line) and eval loss (points) on one axis, with
                                     perplexity = exp(loss) as a second scale on the right (ticks at
                                     powers of ten: the quantity papers quote, read off the same
                                     curve); the OOM ladder's and the guard's decisions as vertical
                                     lines, and each restart after a failed rank (events.jsonl "fault"
                                     and "restart" records) as a line at the step it resumed from
    "Throughput"                     tokens/s of each logged interval; MFU as a second scale when the
                                     run knows its GPU's peak
    "Memory"                         per logged interval: the GPU's peak allocated, the host's peak
                                     resident set (older runs without either: no panel)
    "Expert load, MoE layer i"       MoE runs: one heatmap per MoE layer, share of the routes each
                                     expert got in each logged interval (columns: logged steps), up to
                                     MAX_HEATMAPS layers, evenly picked
    "MaxVio and dropped fraction"    MoE runs: the worst layer's MaxVio (left), the mean dropped
                                     fraction (right)
    "MoD skip rate"                  MoD runs: per MoD layer
    "Orchestrator decisions"         runs with decisions: one row per policy, a marker per decision

After a rollback the rolled-back steps are trained again; the curves show the run as it ended (the
last record of each step), and the rollback is a decision on the timeline. Matplotlib's Agg canvas
draws the figure (no display, no pyplot global state). No torch is imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptive.errors import AdaptiveError
from adaptive.orchestrator.events import EVENTS_FILE
from adaptive.orchestrator.run_records import read_records


def peak_bytes(record: dict[str, Any]) -> int | None:
    """A train record's peak memory: the CUDA device's peak allocated, else (a CPU run) the process's peak RSS.
    The loop's end-of-run summary reads them alike (train/reporting/summary.py); the orchestrator may not import
    the loop's modules (tests/test_import_graph.py)."""
    memory = record.get("memory")
    if memory and memory.get("peak_allocated_bytes") is not None:
        return memory["peak_allocated_bytes"]
    return record.get("peak_rss_bytes")


METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.png"
MAX_HEATMAPS = 8
FIG_WIDTH = 14.0  # inches; the height is the sum of the rows drawn
ROW_HEIGHTS = {"loss": 3.6, "pair": 3.0, "heatmaps": 3.0, "decisions": 2.4}
DPI = 100
ROUTINE = ("bias_update",)  # decisions too frequent to label
LINE_POLICIES = ("oom", "guard")  # decisions that interrupt training: also drawn across the loss panel


@dataclass
class RunData:
    run_dir: Path
    start: dict[str, Any] | None
    train: list[dict[str, Any]]  # the last record of each step, by step
    evals: list[dict[str, Any]]
    rollbacks: list[dict[str, Any]]
    end: dict[str, Any] | None
    decisions: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    restarts: list[dict[str, Any]] = field(default_factory=list)  # {restart, step, checkpoint, fault (or None)}
    skipped_lines: int = 0  # lines of metrics.jsonl / events.jsonl that were not records of the right shape

    @property
    def steps(self) -> list[int]:
        return [r["step"] for r in self.train]

    def series(self, key: str) -> list[Any]:
        return [r.get(key) for r in self.train]


def load_run(run_dir: str | Path) -> RunData:
    """Read a run folder; AdaptiveError when it has no training records."""
    root = Path(run_dir)
    metrics = root / METRICS_FILE
    if not root.is_dir():
        raise AdaptiveError(f"run folder {str(run_dir)!r} does not exist")
    if not metrics.is_file():
        raise AdaptiveError(f"{str(run_dir)!r} has no {METRICS_FILE}: is it a run's --output-dir?")
    records, skipped = read_records(metrics)
    by_step: dict[int, dict[str, Any]] = {}
    shapes: dict[str, Any] = {}  # per-layer series keep the shape of their first record (the model's layers)
    for r in records:
        if r.get("kind") != "train":
            continue
        shape = {k: _shape(r.get(k)) for k in ("expert_counts", "mod_skip_rate", "dropped_fraction") if r.get(k)}
        if any(shapes.setdefault(k, v) != v for k, v in shape.items()):
            skipped += 1
            continue
        by_step[r["step"]] = r  # a replay after a rollback supersedes the first try
    if not by_step:
        unread = f" ({skipped} unreadable line(s) skipped)" if skipped else ""
        raise AdaptiveError(f"{metrics} has no training records yet{unread}")
    evals_by_step = {r["step"]: r for r in records if r.get("kind") == "eval"}
    starts = [r for r in records if r.get("kind") == "start"]
    ends = [r for r in records if r.get("kind") == "end"]
    events, skipped_events = read_records(root / EVENTS_FILE) if (root / EVENTS_FILE).is_file() else ([], 0)
    summaries = [e for e in events if e.get("kind") == "summary"]
    return RunData(run_dir=root, start=starts[0] if starts else None, train=[by_step[s] for s in sorted(by_step)],
                   evals=[evals_by_step[s] for s in sorted(evals_by_step)],
                   rollbacks=[r for r in records if r.get("kind") == "rollback"], end=ends[-1] if ends else None,
                   decisions=[e for e in events if e.get("kind") == "decision"],
                   summary=summaries[-1] if summaries else None, restarts=restarts(events),
                   skipped_lines=skipped + skipped_events)


def restarts(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each restart, with the failure before it (the last fault record of the attempt it replaced)."""
    out, fault = [], None
    for e in events:
        if e.get("kind") == "fault":
            fault = e
        elif e.get("kind") == "restart":
            out.append({**e, "fault": fault})
            fault = None
    return out


def restart_label(restart: dict[str, Any]) -> str:
    fault = restart.get("fault")
    why = f": rank {fault.get('rank')} {fault.get('reason')}" if fault else ""
    return f"restart {restart.get('restart')} from step {restart.get('step')}{why}"


def _shape(value: Any) -> tuple[int, ...]:
    """(layers,) or (layers, experts) of a per-layer series."""
    return (len(value), *sorted({len(row) for row in value if isinstance(row, list)}))


def _num(values: list[Any]) -> list[float]:
    return [float("nan") if v is None else float(v) for v in values]


def heatmap_layers(num_layers: int, limit: int = MAX_HEATMAPS) -> list[int]:
    """Which MoE layers get a heatmap: all, or `limit` evenly spread including the first and last."""
    if num_layers <= limit:
        return list(range(num_layers))
    return sorted({round(i * (num_layers - 1) / (limit - 1)) for i in range(limit)})


def load_shares(run: RunData, layer: int) -> tuple[list[int], list[list[float]]]:
    """(steps, [expert][step] share of the layer's routes) over the logged intervals with counts."""
    steps, columns = [], []
    for r in run.train:
        counts = r.get("expert_counts")
        if not counts:
            continue
        row = counts[layer]
        total = sum(row)
        steps.append(r["step"])
        columns.append([c / total if total else 0.0 for c in row])
    experts = len(columns[0]) if columns else 0
    return steps, [[col[e] for col in columns] for e in range(experts)]


def build_figure(run: RunData) -> Any:
    """The report as a matplotlib Figure (Agg canvas attached), with the panels this run has data for."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = run.steps
    moe = any(r.get("expert_counts") for r in run.train)
    mod = any(r.get("mod_skip_rate") for r in run.train)
    memory = any(peak_bytes(r) is not None for r in run.train)
    # each row: (kind, [panel drawers]); two drawers share a row side by side
    rows: list[tuple[str, list[Any]]] = [("loss", [_loss_panel])]
    rows.append(("pair", [_throughput_panel, _memory_panel] if memory else [_throughput_panel]))
    if moe:
        rows.append(("heatmaps", [_heatmaps]))
    balance = [d for d, has in ((_balance_panel, moe), (_mod_panel, mod)) if has]
    if balance:
        rows.append(("pair", balance))
    if run.decisions:
        rows.append(("decisions", [_decisions_panel]))
    heights = [ROW_HEIGHTS[kind] for kind, _ in rows]
    fig = Figure(figsize=(FIG_WIDTH, sum(heights) + 0.6), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(len(rows), 2, height_ratios=heights)
    title = run.run_dir.name
    if run.start:
        title = f"{run.start.get('preset')} {run.start.get('arch')}: {run.run_dir}"
    fig.suptitle(title)
    for i, (kind, drawers) in enumerate(rows):
        if kind == "heatmaps":
            _heatmaps(fig, grid[i, :], run)
            continue
        slots = [grid[i, :]] if len(drawers) == 1 else [grid[i, 0], grid[i, 1]]
        for drawer, slot in zip(drawers, slots):
            drawer(fig.add_subplot(slot), run, steps)
    return fig


def _loss_panel(ax: Any, run: RunData, steps: list[int]) -> None:
    import numpy as np
    from matplotlib.ticker import LogLocator

    ax.set_title("Loss")
    ax.plot(steps, _num(run.series("loss")), color="tab:blue", label="train loss")
    if run.evals:
        ax.plot([e["step"] for e in run.evals], _num([e.get("eval_loss") for e in run.evals]), "o", color="tab:green",
                label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats per token)")
    # perplexity = exp(loss) is a relabelling of the same axis, not a second curve
    ppl = ax.secondary_yaxis("right", functions=(lambda x: np.exp(np.clip(x, -700.0, 700.0)),
                                                 lambda y: np.log(np.clip(y, 1e-300, None))))
    ppl.set_ylabel("perplexity")
    low, high = ax.get_ylim()
    if high - low > math.log(10.0):  # a decade or more: ticks at 1, 2, 5 x 10^k, evenly spread on the loss axis
        ppl.yaxis.set_major_locator(LogLocator(base=10.0, subs=(1.0, 2.0, 5.0)))
    for event in run.decisions:
        if event["policy"] not in LINE_POLICIES:
            continue
        ax.axvline(event["step"], color="tab:red", alpha=0.35, linestyle="--")
        ax.annotate(f"{event['policy']}: {event['action']}", (event["step"], 1.0), xycoords=("data", "axes fraction"),
                    rotation=90, fontsize=7, va="top", ha="right", color="tab:red")
    for restart in run.restarts:
        ax.axvline(restart["step"], color="black", alpha=0.5, linestyle=":")
        ax.annotate(restart_label(restart)[:80], (restart["step"], 0.0), xycoords=("data", "axes fraction"),
                    rotation=90, fontsize=7, va="bottom", ha="right", color="black")
    ax.legend(loc="upper right", fontsize=8)


def _throughput_panel(ax: Any, run: RunData, steps: list[int]) -> None:
    ax.set_title("Throughput")
    speeds = run.series("tokens_per_s")
    ax.plot(steps, _num(speeds), color="tab:cyan", marker=".", label="tokens/s (logged interval)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("tokens/s")
    mean = (run.end or {}).get("tokens_per_s")
    if mean:
        ax.axhline(mean, color="tab:cyan", linestyle="--", alpha=0.6, label=f"run mean {mean:,.0f} (first step left out)")
    ax.set_ylim(bottom=0.0)
    ax.legend(loc="lower right", fontsize=8)
    ratios = {round(m / t, 12) for m, t in zip(run.series("mfu"), speeds) if m is not None and t}
    if len(ratios) == 1:  # MFU is tokens/s times a constant (the seq_len in force set it): a second scale
        ratio = ratios.pop()
        mfu = ax.secondary_yaxis("right", functions=(lambda x: 100.0 * x * ratio, lambda y: y / (100.0 * ratio)))
        mfu.set_ylabel("MFU %")


def _memory_panel(ax: Any, run: RunData, steps: list[int]) -> None:
    ax.set_title("Memory")
    gpu = [(r.get("memory") or {}).get("peak_allocated_bytes") for r in run.train]
    host = run.series("peak_rss_bytes")
    top = 0.0
    for values, label, color in ((gpu, "GPU peak allocated (interval)", "tab:red"),
                                 (host, "host peak RSS (so far)", "tab:gray")):
        if any(v is not None for v in values):
            ax.plot(steps, [float("nan") if v is None else v / 2**30 for v in values], color=color, marker=".",
                    label=label)
            top = max(top, max(v for v in values if v is not None) / 2**30)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("GiB")
    ax.set_ylim(0.0, 1.15 * top or 1.0)
    ax.legend(loc="lower right", fontsize=8)


def _heatmaps(fig: Any, slot: Any, run: RunData) -> None:
    first = next(r["expert_counts"] for r in run.train if r.get("expert_counts"))
    layers = heatmap_layers(len(first))
    sub = slot.subgridspec(1, len(layers))
    image = None
    for i, layer in enumerate(layers):
        ax = fig.add_subplot(sub[0, i])
        steps, shares = load_shares(run, layer)
        image = ax.imshow(shares, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0.0,
                          vmax=max(0.5, max(max(row) for row in shares)),
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, len(shares) - 0.5, -0.5))
        ax.set_title(f"Expert load, MoE layer {layer}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        if i == 0:
            ax.set_ylabel("expert")
    if image is not None:
        fig.colorbar(image, ax=fig.axes[-len(layers):], shrink=0.8, label="share of routes")


def _balance_panel(ax: Any, run: RunData, steps: list[int]) -> None:
    ax.set_title("MaxVio and dropped fraction")
    vio = run.series("max_vio_max")
    ax.plot(steps, _num(vio), color="tab:purple", label="MaxVio (worst layer)")
    ax.set_ylabel("MaxVio")
    ax.set_xlabel("optimizer step")
    twin = ax.twinx()
    dropped = [sum(d) / len(d) if d else None for d in run.series("dropped_fraction")]
    twin.plot(steps, _num(dropped), color="tab:red", label="dropped fraction (mean of layers)")
    twin.set_ylabel("dropped fraction")
    lines, more = ax.get_legend_handles_labels(), twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right", fontsize=8)


def _mod_panel(ax: Any, run: RunData, steps: list[int]) -> None:
    ax.set_title("MoD skip rate")
    rates = run.series("mod_skip_rate")
    first = next(r for r in rates if r)
    for j in range(len(first)):
        ax.plot(steps, _num([r[j] if r else None for r in rates]), label=f"MoD layer {j}")
    ax.set_ylim(0.0, 1.0)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("fraction of tokens skipping")
    ax.legend(loc="lower right", fontsize=8)


def _decisions_panel(ax: Any, run: RunData, steps: list[int]) -> None:
    ax.set_title("Orchestrator decisions")
    policies = sorted({e["policy"] for e in run.decisions}, key=lambda p: (p == "balance", p))
    for row, policy in enumerate(policies):
        events = [e for e in run.decisions if e["policy"] == policy]
        ax.plot([e["step"] for e in events], [row] * len(events), "|" if policy == "balance" else "v",
                markersize=10, label=policy)
        if all(e["action"] in ROUTINE for e in events):
            continue
        for e in events:
            ax.annotate(e["action"], (e["step"], row), textcoords="offset points", xytext=(3, 5), fontsize=7,
                        rotation=20)
    ax.set_yticks(range(len(policies)), policies)
    ax.set_ylim(-0.7, max(len(policies), 1) - 0.3 + 0.5)
    if steps:
        ax.set_xlim(min(steps) - 1, max(steps) + 1)
    ax.set_xlabel("optimizer step")


def run_summary(run: RunData) -> dict[str, Any]:
    """The numbers the CLI prints beside the picture."""
    last, first = run.train[-1], run.train[0]
    out: dict[str, Any] = {
        "run_dir": str(run.run_dir),
        "model": f"{run.start.get('preset')} {run.start.get('arch')}" if run.start else None,
        "steps": last["step"], "tokens_seen": last.get("tokens_seen"),
        "loss_first": first.get("loss"), "loss_last": last.get("loss"), "ppl_last": last.get("ppl"),
        "eval_loss": run.evals[-1].get("eval_loss") if run.evals else None,
        "max_vio_first": first.get("max_vio_max"), "max_vio_last": last.get("max_vio_max"),
        "dropped_last": _mean(last.get("dropped_fraction")), "mod_skip_last": _mean(last.get("mod_skip_rate")),
        "skipped_steps": last.get("skipped_steps"), "rollbacks": len(run.rollbacks),
        "restarts": [restart_label(r) for r in run.restarts],
        "decisions": {}, "finished": run.end is not None,
        "orchestrator": (run.start or {}).get("orchestrator"),  # {requested, enabled, reason}
        "skipped_lines": run.skipped_lines,
        **timing(run),
    }
    for e in run.decisions:
        out["decisions"].setdefault(e["policy"], {}).setdefault(e["action"], 0)
        out["decisions"][e["policy"]][e["action"]] += 1
    ep = (run.summary or {}).get("ep") or {}
    if ep.get("recommended_ep_size") is not None:
        out["ep_recommendation"] = {"ep_size": ep["recommended_ep_size"], "reason": ep.get("reason")}
    return out


def timing(run: RunData) -> dict[str, Any]:
    """Wall time, tokens/s, MFU and peak memory: the end record's (adaptive.train.reporting.summary says how each is
    taken); a run that has not finished gets the logged intervals' mean speed (first step's warm-up included), and
    its highest logged memory, and no wall time."""
    end = run.end or {}
    if end.get("tokens_per_s") is not None:
        return {"wall_seconds": end.get("wall_seconds"), "launches": end.get("launches", 1),
                "train_seconds_total": end.get("train_seconds_total"), "tokens_per_s": end["tokens_per_s"],
                "tokens_per_s_basis": "this launch, first step left out", "mfu": end.get("mfu"),
                "peak_memory_bytes": end.get("peak_memory_bytes"), "peak_memory_kind": end.get("peak_memory_kind")}
    tokens = seconds = 0.0
    for r in run.train:
        speed, interval = r.get("tokens_per_s"), r.get("train_seconds")
        if not speed:
            continue
        interval = interval if interval is not None else (r.get("interval_steps") or 0) * \
            ((run.start or {}).get("tokens_per_step") or 0) / speed
        tokens, seconds = tokens + speed * interval, seconds + interval
    peaks = [b for b in map(peak_bytes, run.train) if b is not None]
    gpu = any((r.get("memory") or {}).get("peak_allocated_bytes") is not None for r in run.train)
    mfus = [r["mfu"] for r in run.train if r.get("mfu") is not None]
    return {"wall_seconds": None, "launches": None,
            "train_seconds_total": seconds or None, "tokens_per_s": tokens / seconds if seconds else None,
            "tokens_per_s_basis": "logged intervals", "mfu": sum(mfus) / len(mfus) if mfus else None,
            "peak_memory_bytes": max(peaks) if peaks else None,
            "peak_memory_kind": ("cuda_allocated" if gpu else "cpu_rss") if peaks else None}


def _mean(values: list[float] | None) -> float | None:
    return sum(values) / len(values) if values else None


def write_report(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, dict[str, Any], Any]:
    """Draw the run into `out` (default RUN_DIR/report.png); returns (path, summary, figure)."""
    run = load_run(run_dir)
    target = Path(out) if out is not None else run.run_dir / REPORT_FILE
    figure = build_figure(run)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(target, dpi=DPI)
    except OSError as err:
        raise AdaptiveError(f"cannot write the report to {str(target)!r}: {err.strerror or err}; pass --out PATH.png "
                            "in a writable folder") from None
    return target, run_summary(run), figure


__all__ = ["DPI", "FIG_WIDTH", "LINE_POLICIES", "REPORT_FILE", "RunData", "build_figure", "heatmap_layers", "load_run",
           "load_shares", "restart_label", "restarts", "run_summary", "timing",
           "write_report"]
