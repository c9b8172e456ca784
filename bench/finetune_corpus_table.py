"""Published, measured fine-tunes vs `adaptive fit`: the fine-tune table in docs/BENCHMARKS.md.

    python bench/finetune_corpus_table.py            # markdown table on stdout, then the error summary
    python bench/finetune_corpus_table.py --sources  # each row's full source and what the entry assumed

Every entry of adaptive/plan/evidence/finetune_runs.json is planned with the knobs its source states, its stack's
included (adaptive/plan/evidence/finetune_corpus.py); the published peak is shown beside the plan's matching quantity
(allocated peak for allocated, active or unnamed counters; allocated + fragmentation allowance for reserved; the whole
GPU peak for process-level figures) with the relative error. Tolerances (tests/plan/evidence/test_finetune_corpus.py):
allocated peaks within 10%, reserved and process-level figures bound the planned allocated peak, every fit/OOM call
right; an excluded row says why.
"""

from __future__ import annotations

import sys

from adaptive.plan.evidence.finetune_corpus import PEAK_TOLERANCE, TWO_SIDED, FinetunePrediction, predictions

GiB = 2**30


def stack(p: FinetunePrediction) -> str:
    k, s = p.entry["knobs"], p.plan.shown.setup
    knobs = [s.framework, s.precision]
    if s.loss:
        knobs.append(f"loss {s.loss}")
    if s.optimizer_in_backward:
        knobs.append("optimizer in backward")
    if s.activation_offload:
        knobs.append("activation offload")
    if k.get("nf4_keeps_input"):
        knobs.append("bnb < 0.43.2")
    return f"{p.entry['stack_kind']}: " + ", ".join(knobs)


def setting(p: FinetunePrediction) -> str:
    s, r = p.plan.shown.setup, p.plan.request
    ft = s.finetune
    method = ft.method if not ft.adapted else f"{ft.method} r{ft.lora_rank} {ft.lora_targets}"
    off = " +offload" if s.offload_params else ""
    return (f"{r.world_size}x{r.gpu.name} {method} Z{s.zero_stage}{off} mb{s.micro_batch_size}x{p.plan.shown.grad_accum}"
            f" s{s.seq_len}{' ckpt' if s.gradient_checkpointing else ''} {s.optimizer}")


def held(p: FinetunePrediction) -> str:
    if "excluded" in p.entry:
        return "excluded: " + p.entry["excluded"]
    if p.published_bytes is None:
        return "call only"
    if p.counter in TWO_SIDED:
        return f"+-{PEAK_TOLERANCE:.0%}"
    return f"bound (allocated {p.allocated_error:+.1%})"


def main() -> None:
    preds = predictions()
    if "--sources" in sys.argv:
        for p in preds:
            print(f"- **{p.id}**: {p.entry['source']}. Assumed: {p.entry['assumed']}.")
        return
    print("| row | stack | setting planned | counter | published | predicted | error | call: published / "
          "predicted | held to |")
    print("|---|---|---|---|---|---|---|---|---|")
    errors: dict[str, list[float]] = {}
    calls = right = 0
    for p in preds:
        o = p.entry["outcome"]
        call = f"{'ran' if o['ran'] else 'OOM'} / {'fits' if p.fits else 'OOM'} {'ok' if p.call_right else 'WRONG'}"
        if "excluded" not in p.entry:
            calls += 1
            right += p.call_right
        if p.published_bytes is None:
            cells = [p.id, stack(p), setting(p), "-", "-", f"{p.memory.peak_gpu_bytes / GiB:.2f} GiB peak", "", call,
                     held(p)]
        else:
            peak = o["peak"]
            cells = [p.id, stack(p), setting(p), p.counter, f"{peak['published']} ({p.published_bytes / GiB:.2f} GiB)",
                     f"{p.predicted_bytes / GiB:.2f} GiB", f"{p.error:+.1%}", call, held(p)]
            group = ("excluded" if "excluded" in p.entry else "held") + f", {p.counter}"
            errors.setdefault(group, []).append(p.error)
        print("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    print()
    print(f"Fit/OOM calls on the rows not excluded: {right}/{calls} right.")
    print()
    print("| rows, counter | rows | median error | largest abs error |")
    print("|---|---|---|---|")
    for key in sorted(errors):
        e = sorted(errors[key])
        print(f"| {key} | {len(e)} | {e[len(e) // 2]:+.1%} | {max(e, key=abs):+.1%} |")


if __name__ == "__main__":
    main()
