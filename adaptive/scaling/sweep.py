"""Run a sweep (continuing what a folder holds), fit one law across its architectures, write law.json and the plot.

    OUT/sweep.json        settings and each point's outcome (state.py), rewritten after every point
    OUT/points/NAME/      one point: point.json, init/ (its initial weights), run/ (the recipe's run folder),
                          train.log
    OUT/law.json          the fitted laws (adaptive.plan.quality.law_file), for `fit --loss-law OUT/law.json`
    OUT/isoflop.png       the curves and the frontier (plot.py)

Each point is recorded before the next starts, so Ctrl-C loses at most the point in progress, and that one
resumes from its last checkpoint. A point that diverges is recorded as such and left out of the fit.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from adaptive.durable import atomic_write_text
from adaptive.errors import AdaptiveError
from adaptive.record import record
from adaptive.scaling import state
from adaptive.scaling.diagnose import diagnose
from adaptive.scaling.fit_law import (MIN_POINTS, MIN_POINTS_PER_ARCH, N_DEFINITION, Fit, JointFit, Observation,
                                      bootstrap_joint, fit_joint, interval)
from adaptive.plan.quality.ranking import LossComparison, compare_losses
from adaptive.scaling.frontier import compute_multiplier, optimum
from adaptive.scaling.grid import Candidate, Point, SweepSettings, candidates, plan_grid
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

    def fit_start(self, points: int, refits: int) -> None:
        """The law's fit begins: `points` observations, then `refits` bootstrap refits (a minute or more)."""

    def refit(self, done: int) -> None:
        """`done` bootstrap refits finished."""

    def fit_end(self, seconds: float) -> None:
        """The fit, its refits and the outputs took `seconds`."""


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
class ComputeMultiplier:
    """An arch's compute multiplier at a budget (compute_multiplier): the fit's, and each refit's in refit order."""

    arch: str
    budget: float
    value: float
    refits: tuple[float, ...]

    @property
    def band(self) -> tuple[float, float]:
        return interval(list(self.refits))


@record
class SweepLaw:
    """The joint law fitted on a sweep, its bootstrap refits, and the points it saw (each the mean of its seeds)."""

    fit: JointFit
    bootstrap: list[JointFit]
    observations: list[Observation]
    budgets: tuple[float, ...]  # the budgets it was fitted on

    @property
    def archs(self) -> tuple[str, ...]:
        return tuple(self.fit.multipliers)

    def refit(self, i: int, arch: str) -> Fit:
        """Refit i as `arch`'s own law."""
        return self.bootstrap[i].for_arch(arch)

    def multiplier_band(self, arch: str) -> tuple[float, float]:
        return interval([r.multipliers[arch] for r in self.bootstrap])

    def compute_multipliers(self, budget: float, cands: dict[str, list[Candidate]]) -> dict[str, ComputeMultiplier]:
        """Per arch, the compute the reference arch needs for the loss the arch reaches at `budget` (each at its best
        size on the ladder `cands`), over `budget`: what the arch's compute is worth."""
        ref = self.fit.reference

        def worth(fit: JointFit, arch: str) -> float:
            return compute_multiplier(fit.for_arch(arch), cands[arch], fit.for_arch(ref), cands[ref], budget)

        return {arch: ComputeMultiplier(arch, budget, worth(self.fit, arch), tuple(worth(r, arch) for r in self.bootstrap))
                for arch in self.archs}

    def verdicts(self, budget: float, cands: dict[str, list[Candidate]]) -> list[LossComparison]:
        """Every pair of archs at `budget`, each at its best size on the ladder `cands`: which reaches the lower loss,
        or a tie, judged as the planner judges (plan/quality/ranking.py: paired refits, and the scatter one run of
        each adds, the fit's residual)."""
        def best(fit: JointFit, arch: str) -> float:
            return optimum(fit.for_arch(arch), budget, cands[arch]).loss

        losses = {a: (best(self.fit, a), [best(r, a) for r in self.bootstrap]) for a in self.archs}
        out = []
        for a, b in itertools.combinations(self.archs, 2):
            (center_a, refits_a), (center_b, refits_b) = losses[a], losses[b]
            out.append(compare_losses(a, center_a, interval(refits_a), refits_a, b, center_b, interval(refits_b),
                                      refits_b, self.fit.rmse_log))
        return out

    def of(self, arch: str) -> list[Observation]:
        return [o for o in self.observations if o.arch == arch]

    def seed_spread(self, arch: str) -> float:
        """The seeds' standard deviation of the log-loss, pooled over the arch's points (0 with one seed)."""
        var = [float(np.var(np.log(o.losses), ddof=1)) for o in self.of(arch) if len(o.losses) > 1]
        return math.sqrt(sum(var) / len(var)) if var else 0.0


def observations(sweep: dict[str, Any], budgets: Sequence[float] | None = None) -> list[Observation]:
    """The done points (at `budgets` only, when given), one per shape, with every seed's loss."""
    by_shape: dict[tuple, list[dict]] = {}
    for p in state.results(sweep):
        if budgets is None or p["budget"] in budgets:
            by_shape.setdefault((p["arch"], p["budget"], p["params"]), []).append(p)
    return [Observation(arch, float(ps[0]["params"]), float(ps[0]["tokens"]), tuple(q["eval_loss"] for q in ps))
            for (arch, _, _), ps in by_shape.items()]


def corpus_tokens(settings: SweepSettings) -> int:
    """The training tokens a point's run sees in one epoch: the corpus tokenized and packed as the recipe does
    (local data is map-style: every block once per epoch), without the eval blocks."""
    from adaptive.train.data.packing import build_datasets
    from adaptive.train.data.sources import DataConfig
    from adaptive.train.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(settings.tokenizer, settings.vocab_size)
    dataset = None if settings.dataset == "builtin" else settings.dataset
    train, _ = build_datasets(DataConfig(dataset=dataset, seq_len=settings.seq_len, seed=settings.seed,
                                         text_field=settings.text_field), tokenizer)
    return train.num_blocks * settings.seq_len


def fit_sweep(sweep: dict[str, Any], budgets: Sequence[float] | None = None, samples: int = 100,
              unique_tokens: float | None = None,
              on_refit: Callable[[int], None] | None = None) -> tuple[SweepLaw | None, list[str]]:
    """The joint law over the archs with enough done points (at `budgets` only, when given), and a line for
    each arch left out; None when none can be fitted. The reference arch is dense when the sweep has it.
    `unique_tokens`: the corpus's training tokens (default: what sweep.json recorded); past them, repeats count
    as Muennighoff et al.'s effective data, with R_D* fitted. `on_refit(done)` after each bootstrap refit."""
    if unique_tokens is None:
        unique_tokens = sweep.get("unique_tokens")
    obs = observations(sweep, budgets)
    counts = {arch: sum(o.arch == arch for o in obs) for arch in sweep["settings"]["archs"]}
    skipped = [f"{arch}: {n} points trained, an arch needs {MIN_POINTS_PER_ARCH}" for arch, n in counts.items()
               if n < MIN_POINTS_PER_ARCH]
    archs = sorted((a for a, n in counts.items() if n >= MIN_POINTS_PER_ARCH), key=lambda a: a != "dense")
    obs = [o for o in obs if o.arch in archs]
    need = MIN_POINTS + len(archs) - 1
    if not archs:
        return None, skipped
    if len(obs) < need:
        return None, [*skipped, f"{'+'.join(archs)}: {len(obs)} points trained, a law needs {need}"]
    fit = fit_joint(obs, tuple(archs), unique_tokens)
    fitted_budgets = tuple(sorted({p["budget"] for p in state.results(sweep) if p["arch"] in archs
                                   and (budgets is None or p["budget"] in budgets)}))
    return SweepLaw(fit, bootstrap_joint(obs, fit, samples=samples, on_refit=on_refit), obs, fitted_budgets), skipped


def law_json(name: str, settings: SweepSettings, law: SweepLaw) -> dict[str, Any]:
    """law.json's content (adaptive.plan.quality.law_file's format)."""
    from adaptive.plan.quality.law_file import arch_dict, file_dict, law_dict, refit_dict

    tokenizer = (f"the tokenizer in {settings.tokenizer}" if settings.tokenizer else "the built-in BPE tokenizer")
    fitted_on = (f"{settings.dataset} ({tokenizer}, vocab {settings.vocab_size}; sequence {settings.seq_len}); final "
                 "eval loss in nats per token")
    source = (f"adaptive scale: isoFLOP sweep, budgets {', '.join(f'{c:.3g}' for c in law.budgets)} FLOPs, "
              f"{settings.sizes} sizes each, {settings.seeds} seed(s) per point; "
              "one law across archs (shared E, A, B, alpha, beta; a multiplier per arch on N, Clark et al. "
              "2022), Huber/L-BFGS fit as Hoffmann et al. 2022, approach 3")
    f = law.fit
    archs = {}
    for arch in law.archs:
        mine = law.of(arch)
        archs[arch] = arch_dict(f.multipliers[arch], (min(o.params for o in mine), max(o.params for o in mine)),
                                (min(o.tokens for o in mine), max(o.tokens for o in mine)), len(mine),
                                max(len(o.losses) for o in mine), law.seed_spread(arch))
    refits = [refit_dict(r.coefficients, r.multipliers, r.repeat_decay) for r in law.bootstrap]
    return file_dict(name, source, fitted_on, f.reference,
                     law_dict(f.coefficients, N_DEFINITION, f.points, f.rmse_log, f.unique_tokens, f.repeat_decay),
                     archs, refits)


def write_outputs(out: Path, sweep: dict[str, Any], law: SweepLaw | None,
                  held_out: Sequence[float] = ()) -> tuple[Path, Path]:
    """OUT/law.json and OUT/isoflop.png."""
    if law is None:
        raise AdaptiveError("no architecture has enough trained points for a law; rerun to finish the sweep")
    from adaptive.scaling.plot import draw

    settings = SweepSettings.from_dict(sweep["settings"])
    law_path = Path(out) / LAW_FILE
    atomic_write_text(law_path, json.dumps(law_json(Path(out).resolve().name, settings, law), indent=1) + "\n")
    cands = {arch: candidates(arch, settings.vocab_size, settings.seq_len) for arch in law.archs}
    plot_path = draw(Path(out) / PLOT_FILE, state.results(sweep), {a: law.fit.for_arch(a) for a in law.archs},
                     cands, held_out, diagnose(sweep, law))
    return law_path, plot_path


def record_corpus_tokens(out: Path, sweep: dict[str, Any]) -> None:
    """sweep.json's unique_tokens (the corpus's training tokens), counted once."""
    if sweep.get("unique_tokens") is None:
        sweep["unique_tokens"] = corpus_tokens(SweepSettings.from_dict(sweep["settings"]))
        state.save(out, sweep)


@record
class Scaled:
    """What `adaptive scale` did: the sweep, the laws, what it wrote, and the archs it could not fit."""

    sweep: dict[str, Any]
    law: SweepLaw
    skipped: list[str]
    law_path: Path
    plot_path: Path
    fit_seconds: float = 0.0  # the fit, its bootstrap refits, law.json and the plot
    warnings: tuple[str, ...] = ()  # where the sweep does not pin the law (diagnose.py)


def scale(settings: SweepSettings, out: Path, events: Events | None = None, jobs: int = 1,
          samples: int = 100) -> Scaled:
    """The sweep (continued), the laws fitted on it, law.json and isoflop.png."""
    events = events or Events()
    sweep = run_sweep(settings, out, events, jobs)
    record_corpus_tokens(out, sweep)
    began = time.monotonic()
    events.fit_start(len(observations(sweep)), samples)
    law, skipped = fit_sweep(sweep, samples=samples, on_refit=events.refit)
    law_path, plot_path = write_outputs(out, sweep, law)
    assert law is not None  # write_outputs refuses None
    seconds = time.monotonic() - began
    events.fit_end(seconds)
    return Scaled(sweep, law, skipped, law_path, plot_path, seconds, tuple(w.text for w in diagnose(sweep, law)))


__all__ = ["BUILTIN_VOCAB", "ComputeMultiplier", "Events", "LAW_FILE", "PLOT_FILE", "POINTS_DIR", "Scaled",
           "SweepLaw", "corpus_tokens", "fit_sweep", "law_json", "observations", "record_corpus_tokens",
           "run_sweep", "scale", "write_outputs"]
