"""One picture of a run, from its metrics.jsonl and events.jsonl (`adaptive report RUN_DIR`).

Panels (each axes carries its title, so a test or a user can find it):

    "Loss and perplexity"            training loss and eval loss (left), perplexity (right); the
                                     OOM ladder's and the guard's decisions as vertical lines, and
                                     each restart after a failed rank (events.jsonl "fault" and
                                     "restart" records) as a line at the step it resumed from
    "Expert load, MoE layer i"       one heatmap per MoE layer: share of the routes each expert got
                                     in each logged interval (columns: logged steps), up to
                                     MAX_HEATMAPS layers, evenly picked
    "MaxVio and dropped fraction"    the worst layer's MaxVio (left), the mean dropped fraction (right)
    "MoD skip rate"                  per MoD layer
    "Orchestrator decisions"         one row per policy, a marker per decision, labelled

After a rollback the rolled-back steps are trained again; the curves show the run as it ended (the
last record of each step), and the rollback is a decision on the timeline. Matplotlib's Agg canvas
draws the figure (no display, no pyplot global state). No torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptive.errors import AdaptiveError
from adaptive.orchestrator.events import EVENTS_FILE
from adaptive.orchestrator.run_records import read_records

METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.png"
MAX_HEATMAPS = 8
FIGSIZE = (14.0, 13.0)
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
    """The report as a matplotlib Figure (Agg canvas attached)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(4, 2, height_ratios=[1.2, 1.0, 1.0, 0.8])
    steps = run.steps
    title = run.run_dir.name
    if run.start:
        title = f"{run.start.get('preset')} {run.start.get('arch')}: {run.run_dir}"
    fig.suptitle(title)

    _loss_panel(fig.add_subplot(grid[0, :]), run, steps)
    _heatmaps(fig, grid[1, :], run)
    _balance_panel(fig.add_subplot(grid[2, 0]), run, steps)
    _mod_panel(fig.add_subplot(grid[2, 1]), run, steps)
    _decisions_panel(fig.add_subplot(grid[3, :]), run, steps)
    return fig


def _loss_panel(ax: Any, run: RunData, steps: list[int]) -> None:
    ax.set_title("Loss and perplexity")
    ax.plot(steps, _num(run.series("loss")), color="tab:blue", label="loss")
    if run.evals:
        ax.plot([e["step"] for e in run.evals], _num([e.get("eval_loss") for e in run.evals]), "o",
                color="tab:green", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    twin = ax.twinx()
    twin.plot(steps, _num(run.series("ppl")), color="tab:orange", alpha=0.6, label="perplexity")
    twin.set_ylabel("perplexity")
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
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right", fontsize=8)


def _heatmaps(fig: Any, slot: Any, run: RunData) -> None:
    first = next((r["expert_counts"] for r in run.train if r.get("expert_counts")), None)
    if not first:
        ax = fig.add_subplot(slot)
        ax.set_title("Expert load")
        ax.text(0.5, 0.5, "no MoE layers in this run", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
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
    if all(v is None for v in vio):
        ax.text(0.5, 0.5, "no MoE layers in this run", ha="center", va="center", transform=ax.transAxes)
        return
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
    first = next((r for r in rates if r), None)
    if not first:
        ax.text(0.5, 0.5, "no MoD layers in this run", ha="center", va="center", transform=ax.transAxes)
        return
    for j in range(len(first)):
        ax.plot(steps, _num([r[j] if r else None for r in rates]), label=f"MoD layer {j}")
    ax.set_ylim(0.0, 1.0)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("fraction of tokens skipping")
    ax.legend(loc="lower right", fontsize=8)


def _decisions_panel(ax: Any, run: RunData, steps: list[int]) -> None:
    ax.set_title("Orchestrator decisions")
    policies = sorted({e["policy"] for e in run.decisions}, key=lambda p: (p == "balance", p))
    if not policies:
        ax.text(0.5, 0.5, "no orchestrator decisions (events.jsonl absent or empty)", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_yticks([])
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
    }
    for e in run.decisions:
        out["decisions"].setdefault(e["policy"], {}).setdefault(e["action"], 0)
        out["decisions"][e["policy"]][e["action"]] += 1
    ep = (run.summary or {}).get("ep") or {}
    if ep.get("recommended_ep_size") is not None:
        out["ep_recommendation"] = {"ep_size": ep["recommended_ep_size"], "reason": ep.get("reason")}
    return out


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


__all__ = ["FIGSIZE", "DPI", "LINE_POLICIES", "REPORT_FILE", "RunData", "build_figure", "heatmap_layers", "load_run",
           "load_shares", "restart_label", "restarts", "run_summary", "write_report"]
