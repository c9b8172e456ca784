"""Run a sweep (continuing what a folder holds), fit the law per architecture, write law.json and the plot.

    OUT/sweep.json        settings and each point's outcome (state.py), rewritten after every point
    OUT/points/NAME/      one point: point.json, init/ (its initial weights), run/ (the recipe's run folder),
                          train.log
    OUT/law.json          the fitted laws (adaptive.plan.quality.law_file), for `fit --loss-law OUT/law.json`
    OUT/isoflop.png       the curves and the frontier (plot.py)

Each point is recorded before the next starts, so Ctrl-C loses at most the point in progress, and that one
resumes from its last checkpoint. A point that diverges is recorded as such and left out of the fit.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from adaptive.durable import atomic_write_text
from adaptive.errors import AdaptiveError
from adaptive.record import record
from adaptive.scaling import state
from adaptive.scaling.fit_law import MIN_POINTS, N_DEFINITION, Fit, bootstrap, fit_law
from adaptive.scaling.grid import Point, SweepSettings, candidates, plan_grid
from adaptive.scaling.runner import Outcome, run_point

LAW_FILE = "law.json"
PLOT_FILE = "isoflop.png"
POINTS_DIR = "points"
BUILTIN_VOCAB = 2048  # the built-in byte-level BPE's (adaptive.train.data.tokenizer.DEFAULT_VOCAB_SIZE)


class Events:
    """What the sweep tells its caller (the CLI draws it); every hook is a no-op here."""

    def begin(self, points: list[Point], done: int) -> None: ...

    def point_start(self, point: Point) -> None: ...

    def step(self, point: Point, step: int) -> None: ...

    def point_end(self, point: Point, outcome: Outcome) -> None: ...


def run_sweep(settings: SweepSettings, out: Path, events: Events | None = None, jobs: int = 1) -> dict[str, Any]:
    """Train every point not yet recorded in `out`, `jobs` at a time; returns sweep.json's content. Ctrl-C
    stops the points in progress (each keeps its last checkpoint) and re-raises KeyboardInterrupt."""
    events = events or Events()
    points = plan_grid(settings)
    sweep = state.start(out, settings, points)
    todo = [p for p in points if sweep["points"][p.name]["status"] == state.PENDING]
    events.begin(points, len(points) - len(todo))
    cancel, lock = threading.Event(), threading.Lock()
    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else None

    def one(point: Point) -> None:
        if cancel.is_set():  # a point failed or Ctrl-C: start no other
            return
        try:
            events.point_start(point)
            outcome = run_point(point, settings, Path(out) / POINTS_DIR / point.name,
                                on_step=lambda step: events.step(point, step), cancel=cancel, threads=threads)
            with lock:  # one writer of sweep.json at a time
                state.finish(sweep, point.name, outcome.eval_loss, outcome.seconds, outcome.diverged)
                state.save(out, sweep)
                events.point_end(point, outcome)
        except BaseException:
            cancel.set()
            raise

    if jobs > 1 and todo and len(todo) == len(points):  # a new sweep's first point alone: it fills the
        # tokenizer's and the data's caches for the rest (a continued sweep has them)
        one(todo.pop(0))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(one, p) for p in todo]
        try:
            for future in futures:
                future.result()  # the first failure stops the rest
        except BaseException:
            cancel.set()
            for future in futures:
                future.cancel()
            raise
    return sweep


@record
class ArchLaw:
    arch: str
    fit: Fit
    bootstrap: list[tuple[float, float, float, float, float]]
    points: list[dict[str, Any]]  # the points it was fitted on

    @property
    def params_range(self) -> tuple[float, float]:
        return (min(p["params"] for p in self.points), max(p["params"] for p in self.points))

    @property
    def tokens_range(self) -> tuple[float, float]:
        return (min(p["tokens"] for p in self.points), max(p["tokens"] for p in self.points))


def fit_sweep(sweep: dict[str, Any], budgets: Sequence[float] | None = None,
              samples: int = 100) -> tuple[dict[str, ArchLaw], list[str]]:
    """Per arch, the law fitted on its done points (at `budgets` only, when given), and a line for each arch
    with too few points to fit."""
    laws, skipped = {}, []
    for arch in sweep["settings"]["archs"]:
        points = [p for p in state.results(sweep) if p["arch"] == arch and (budgets is None or p["budget"] in budgets)]
        if len(points) < MIN_POINTS:
            skipped.append(f"{arch}: {len(points)} points trained, a law needs {MIN_POINTS}")
            continue
        n, d, loss = ([p[k] for p in points] for k in ("params", "tokens", "eval_loss"))
        fit = fit_law(n, d, loss)
        laws[arch] = ArchLaw(arch, fit, bootstrap(n, d, loss, fit, samples=samples), points)
    return laws, skipped


def law_json(name: str, settings: SweepSettings, laws: dict[str, ArchLaw]) -> dict[str, Any]:
    """law.json's content (adaptive.plan.quality.law_file's format)."""
    from adaptive.plan.quality.law_file import file_dict, law_dict
    from adaptive.plan.quality.laws import DenseLaw

    fitted_on = (f"{settings.dataset} (the built-in BPE tokenizer, vocab {settings.vocab_size}; sequence "
                 f"{settings.seq_len}); final eval loss in nats per token")
    budgets = sorted({p["budget"] for law in laws.values() for p in law.points})  # the ones fitted on
    source = (f"adaptive scale: isoFLOP sweep, budgets {', '.join(f'{c:.3g}' for c in budgets)} FLOPs, "
              f"{settings.sizes} sizes each; Huber/L-BFGS fit as Hoffmann et al. 2022, approach 3")
    entries = {}
    for arch, law in laws.items():
        f = law.fit
        dense = DenseLaw(name=f"{name}:{arch}", E=f.E, A=f.A, B=f.B, alpha=f.alpha, beta=f.beta, source=source,
                         fitted_on=fitted_on, n_definition=N_DEFINITION, params_range=law.params_range,
                         tokens_range=law.tokens_range)
        entries[arch] = law_dict(dense, f.points, f.rmse_log, law.bootstrap)
    return file_dict(name, source, fitted_on, entries)


def write_outputs(out: Path, sweep: dict[str, Any], laws: dict[str, ArchLaw],
                  held_out: Sequence[float] = ()) -> tuple[Path, Path]:
    """OUT/law.json and OUT/isoflop.png."""
    if not laws:
        raise AdaptiveError("no architecture has enough trained points for a law; rerun to finish the sweep")
    from adaptive.scaling.plot import draw

    settings = SweepSettings.from_dict(sweep["settings"])
    law_path = Path(out) / LAW_FILE
    atomic_write_text(law_path, json.dumps(law_json(Path(out).resolve().name, settings, laws), indent=1) + "\n")
    cands = {arch: candidates(arch, settings.vocab_size, settings.seq_len) for arch in laws}
    plot_path = draw(Path(out) / PLOT_FILE, state.results(sweep), {a: law.fit for a, law in laws.items()}, cands,
                     held_out)
    return law_path, plot_path


@record
class Scaled:
    """What `adaptive scale` did: the sweep, the laws, what it wrote, and the archs it could not fit."""

    sweep: dict[str, Any]
    laws: dict[str, ArchLaw]
    skipped: list[str]
    law_path: Path
    plot_path: Path


def scale(settings: SweepSettings, out: Path, events: Events | None = None, jobs: int = 1,
          samples: int = 100) -> Scaled:
    """The sweep (continued), the laws fitted on it, law.json and isoflop.png."""
    sweep = run_sweep(settings, out, events, jobs)
    laws, skipped = fit_sweep(sweep, samples=samples)
    law_path, plot_path = write_outputs(out, sweep, laws)
    return Scaled(sweep, laws, skipped, law_path, plot_path)


__all__ = ["ArchLaw", "BUILTIN_VOCAB", "Events", "LAW_FILE", "PLOT_FILE", "POINTS_DIR", "Scaled", "fit_sweep",
           "law_json", "run_sweep", "scale", "write_outputs"]
