"""How `adaptive scale` shows itself: a rich progress bar over the sweep's points (with the time the rest will take,
from the points run so far: adaptive/scaling/eta.py) and one per point in training, a line per finished point, a
status line while the law is fitted, then the results, the fitted law and what the sweep does not pin."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from adaptive.scaling import state
from adaptive.scaling.eta import duration, eta_seconds
from adaptive.scaling.sweep import Events, Scaled

console = Console(stderr=False, highlight=False)


class SweepView(Events):
    def __init__(self, points: list[Any], out: Path | None = None, jobs: int = 1) -> None:
        self.points = points
        self.out, self.jobs = out, jobs
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[eta]}"), console=console,
                                 transient=False)
        self.overall: Any = None
        self.tasks: dict[str, Any] = {}
        self.finished: list[tuple[float, float]] = []  # (tokens, seconds) of each point timed so far (eta.py)
        self.remaining: dict[str, float] = {p.name: p.tokens for p in points}  # name -> tokens, not yet finished
        self.status: Any = None  # the fit's status line, while it runs
        self.refits, self.fit_text = 0, ""

    def __enter__(self) -> SweepView:
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.status is not None:
            self.status.stop()
        self.progress.stop()

    def begin(self, points: list[Any], done: int) -> None:
        recorded = (state.load(self.out) or {"points": {}})["points"] if self.out is not None else {}
        for name, p in recorded.items():
            if p["status"] != state.PENDING and name in self.remaining:
                del self.remaining[name]
                if p.get("seconds"):  # a point harvested from its run folder was not timed
                    self.finished.append((p["tokens"], p["seconds"]))
        self.overall = self.progress.add_task("[bold]sweep points", total=len(points), completed=done, eta="")
        if done:
            self.progress.console.print(f"continuing the sweep: {done} of {len(points)} points done already")
        self._update_eta()

    def eta(self) -> str:
        """The rest of the sweep in words, from the points timed so far ('' before the first)."""
        left = eta_seconds(self.finished, list(self.remaining.values()), self.jobs)
        if left is None or not self.remaining:
            return ""
        return f"about {duration(left)} left for {len(self.remaining)} point(s)"

    def _update_eta(self) -> None:
        self.progress.update(self.overall, eta=self.eta())

    def point_start(self, point: Any) -> None:
        self.tasks[point.name] = self.progress.add_task(f"  {point.name}", total=point.steps, eta="")

    def step(self, point: Any, step: int) -> None:
        if point.name in self.tasks:
            self.progress.update(self.tasks[point.name], completed=step)

    def point_end(self, point: Any, outcome: Any) -> None:
        task = self.tasks.pop(point.name, None)
        if task is not None:
            self.progress.remove_task(task)
        self.progress.advance(self.overall)
        self.remaining.pop(point.name, None)
        if outcome.seconds > 0:
            self.finished.append((point.tokens, outcome.seconds))
        self._update_eta()
        eta = self.eta()
        eta = f"; {eta}" if eta else ""
        if outcome.diverged:
            self.progress.console.print(f"[yellow]warning:[/] {point.name} diverged ({outcome.diverged}); it is "
                                        f"left out of the fit ({outcome.seconds:.0f} s{eta})")
        else:
            self.progress.console.print(f"{point.name}: N {point.params:,}, D {point.tokens:,} tokens, loss "
                                        f"{outcome.eval_loss:.4f} ({outcome.seconds:.0f} s{eta})")

    def fit_start(self, points: int, refits: int) -> None:
        self.progress.stop()  # one live display at a time: the status line replaces the bars
        self.refits = refits
        self.fit_text = f"fitting the loss law to {points} points, then {refits} bootstrap refits"
        self.status = console.status(self.fit_text + "…")
        self.status.start()

    def refit(self, done: int) -> None:
        if self.status is not None:
            self.status.update(f"{self.fit_text}: refit {done} of {self.refits}…")

    def fit_end(self, seconds: float) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None
        console.print(f"fitted the law, its {self.refits} bootstrap refits and the plot in {duration(seconds)}")

    def interrupted(self, out: Path) -> None:
        sweep = state.load(out) or {"points": {}}
        done = sum(1 for p in sweep["points"].values() if p["status"] != state.PENDING)
        console.print(f"interrupted: {done} of {len(sweep['points'])} points recorded in {Path(out) / state.SWEEP_FILE}"
                      "; rerun the same command to continue (a point in progress resumes from its checkpoint)")


def _interval(values: list[float]) -> str:
    from adaptive.scaling.fit_law import interval

    lo, hi = interval(values)
    return f"{lo:.3g}-{hi:.3g}"


def law_table(law: Any) -> Table:
    """The shared coefficients, then each arch's multiplier, each with its bootstrap 5-95%."""
    f, boot = law.fit, law.bootstrap
    t = Table(title=f"One law: L(N, D) = E + A / (k N)^alpha + B / D^beta  (rmse of log-loss {f.rmse_log:.4f}, "
                    f"{f.points} points; k: each arch's effective parameters, {f.reference} = 1)")
    for column in ("coefficient", "fit", "5-95%", "seed spread (log-loss sd)"):
        t.add_column(column, justify="left" if column == "coefficient" else "right")
    for i, name in ((0, "E"), (1, "A"), (3, "alpha"), (2, "B"), (4, "beta")):
        t.add_row(name, f"{f.coefficients[i]:.3g}", _interval([b.coefficients[i] for b in boot]) if boot else "", "")
    if f.repeat_decay is not None:
        t.add_row("R_D*", f"{f.repeat_decay:.3g}", _interval([b.repeat_decay for b in boot]) if boot else "",
                  f"repeats of {f.unique_tokens:,.0f} tokens")
    for arch, k in f.multipliers.items():
        lo, hi = law.multiplier_band(arch)
        spread = law.seed_spread(arch)
        t.add_row(f"k {arch}", f"{k:.3f}", "(reference)" if arch == f.reference else f"{lo:.3f}-{hi:.3f}",
                  f"{spread:.4f}" if spread else "one seed")
    return t


def compute_lines(law: Any, settings: dict[str, Any], budget: float | None = None) -> list[str]:
    """What each arch's compute is worth at `budget` (default: the largest fitted), then every pair: which reaches
    the lower loss there, or a tie, in words."""
    from adaptive.scaling.grid import candidates

    budget = budget or max(law.budgets)
    ref = law.fit.reference
    cands = {a: candidates(a, settings["vocab_size"], settings["seq_len"]) for a in law.archs}
    lines = []
    for arch, m in law.compute_multipliers(budget, cands).items():
        if arch != ref:
            lo, hi = m.band
            lines.append(f"at {budget:.3g} FLOPs, {arch} = {m.value:.2f}x {ref} compute ({lo:.2f}-{hi:.2f}): {ref} at "
                         f"its best size needs {m.value:.2f}x the FLOPs for the loss {arch} reaches at its best size")
    return lines + [f"at {budget:.3g} FLOPs, {v.words()}" for v in law.verdicts(budget, cands)]


def show_result(done: Scaled) -> None:
    points = sorted(done.sweep["points"].values(), key=lambda p: (p["arch"], p["budget"], p["params"]))
    t = Table(title="isoFLOP sweep (final eval loss, nats/token)")
    for column in ("arch", "budget FLOPs", "width", "N active", "tokens", "loss"):
        t.add_column(column, justify="left" if column == "arch" else "right", overflow="fold")
    from adaptive.scaling.diagnose import edge_optima

    edges = {(w.arch, w.budget, w.width) for w in edge_optima(done.sweep)}
    for p in points:
        at = [q for q in points if q["arch"] == p["arch"] and q["budget"] == p["budget"] and q["status"] == state.DONE]
        best = at and min(at, key=lambda q: q["eval_loss"]) is p
        edge = " [yellow](edge)[/]" if best and (p["arch"], p["budget"], p["width"]) in edges else ""
        loss = (f"{p['eval_loss']:.4f}" + (" *" if best else "") + edge) if p["status"] == state.DONE else \
            f"[yellow]{p['status']}[/]"
        t.add_row(p["arch"], f"{p['budget']:.3g}", str(p["width"]), f"{p['params']:,}", f"{p['tokens']:,}", loss)
    console.print(t)
    console.print("* the budget's best size" + ("; (edge): the smallest or largest width swept, see the warnings"
                                                if edges else ""))
    console.print(law_table(done.law))
    for line in compute_lines(done.law, done.sweep["settings"]):
        console.print(line)
    for p in state.results(done.sweep, state.DIVERGED):
        console.print(f"[yellow]warning:[/] {p['name']} diverged ({p.get('reason')}); left out of the fit")
    for line in done.skipped:
        console.print(f"[yellow]warning:[/] no law for {line}")
    for line in done.warnings:
        console.print(f"[yellow]warning:[/] {line}")
    console.print(f"wrote {done.law_path} (use it: adaptive fit --loss-law {done.law_path}) and {done.plot_path}")
