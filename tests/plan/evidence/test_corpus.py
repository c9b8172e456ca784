"""`fit` against published runs (adaptive/plan/evidence/corpus_runs.json): the done-when criteria of issue 10.

Every entry is planned with the knobs its source states; the outcome must match within the stated
tolerances where the run's stack is the kind `fit` models, and the error is shown (docs/BENCHMARKS.md,
bench/corpus_table.py) everywhere else.
"""

import pytest

from adaptive.plan.evidence.corpus import (GPU_HOURS_TOLERANCE, LARGE_GPU_HOURS_RUNS, LARGE_GPU_HOURS_TOLERANCE,
                                  TOKENS_PER_S_TOLERANCE, comparisons, is_dense_up_to_13b, load, predict)
from adaptive.plan.search.tight import TIGHT_MARGIN
from tests.conftest import REPO_ROOT

REASON_405B = (
    "+38%: at sequence 8192 a 405B layer stack fits 80 GB under AutoTP 8 only with full recompute (AutoTP keeps 10/34 "
    "of a layer's activations whole: no Megatron sequence parallel), which caps MFU at 0.40 x 3/4 = 0.30 before "
    "communication; Meta's TP 8 x PP 16 ran at 38-43%. DeepSpeed's pipeline does not close the gap: its "
    "non-interleaved 1F1B at 32 micro-batches over 16 stages idles 15/47 of the step, and the first stages, holding "
    "up to 16 micro-batches, need full recompute too (test_405b_on_deepspeeds_pipeline_at_metas_layout)")
CATEGORIES = {"DeepSpeed ZeRO papers and tutorials", "llm-foundry throughput table", "torchtitan performance page",
              "Llama 2 / Llama 3 GPU-hours", "DeepSpeed / transformers OOM reports", "Korthikanti et al. activation formula",
              "MoE training report"}


@pytest.fixture(scope="module")
def predictions():
    return [predict(e) for e in load()]


def figure(p, name):
    found = [c for c in comparisons(p) if c[0] == name]
    return found[0] if found else None


def test_corpus_has_at_least_30_cited_runs_in_every_category():
    entries = load()
    assert len(entries) >= 30
    assert CATEGORIES <= {e["category"] for e in entries}
    assert len({e["id"] for e in entries}) == len(entries)
    for e in entries:
        assert len(e["source"]) > 40 and e["stack"] and e["outcome"], e["id"]


def test_every_run_of_our_stack_gets_the_right_fit_or_oom_call(predictions):
    checked = [p for p in predictions if p.entry["stack_kind"] == "ours" and "ran" in p.entry["outcome"]]
    assert len(checked) >= 8 and any(not p.entry["outcome"]["ran"] for p in checked)  # OOMs included
    wrong = [(p.id, p.fits, round(p.peak_gib, 2)) for p in checked if p.fits != p.entry["outcome"]["ran"]]
    assert not wrong


def test_the_v100_llama7b_zero2_oom_is_called_and_its_zero3_rerun_fits(predictions):
    by_id = {p.id: p for p in predictions}
    oom = by_id["llamafactory-1221-llama7b-8xv100-zero2-oom"]
    assert not oom.fits and oom.plan.shown.memory.peak_phase == "optimizer_step"
    assert by_id["llamafactory-1221-llama7b-8xv100-zero3-ran"].fits


def test_gpu_hours_within_15_percent_for_dense_models_up_to_13b(predictions):
    rows = [(p, figure(p, "GPU-hours")) for p in predictions if is_dense_up_to_13b(p.entry)]
    rows = [(p, f) for p, f in rows if f is not None]
    assert len(rows) >= 5
    held = [(p.id, f[3]) for p, f in rows if "gpu_hours" not in p.entry.get("exempt", {})]
    assert len(held) >= 3
    assert all(abs(err) <= GPU_HOURS_TOLERANCE for _, err in held), held


@pytest.mark.parametrize("run", [
    "llama2-70b-gpu-hours", "llama3-70b-gpu-hours",
    pytest.param("llama3.1-405b-gpu-hours", marks=pytest.mark.xfail(strict=True, reason=REASON_405B)),
])
def test_meta_70b_and_405b_gpu_hours_within_30_percent_at_their_gpu_counts(predictions, run):
    assert run in LARGE_GPU_HOURS_RUNS
    p = next(p for p in predictions if p.id == run)
    s = p.plan.shown.setup
    assert p.fits and s.dp_size * s.micro_batch_size * p.plan.shown.grad_accum * s.seq_len == \
        p.entry["knobs"]["global_batch_tokens"]  # the published batch, each sequence counted once
    _, published, predicted, err = figure(p, "GPU-hours")
    assert abs(err) <= LARGE_GPU_HOURS_TOLERANCE, (run, published, predicted)


def test_tokens_per_s_within_20_percent_for_runs_of_our_stack(predictions):
    rows = [(p.id, figure(p, "tokens/s per GPU")) for p in predictions if p.entry["stack_kind"] == "ours"]
    rows = [(i, f[3]) for i, f in rows if f is not None]
    assert len(rows) >= 8
    assert all(abs(err) <= TOKENS_PER_S_TOLERANCE for _, err in rows), rows


def test_tight_margin_is_the_largest_peak_underprediction_on_our_stack(predictions):
    errors = [figure(p, "peak GiB")[3] for p in predictions
              if p.entry["stack_kind"] == "ours" and figure(p, "peak GiB") and "peak" not in p.entry.get("exempt", {})]
    worst_under = -min(errors)
    assert worst_under > 0
    assert TIGHT_MARGIN == pytest.approx(worst_under, abs=0.005)


def test_benchmarks_doc_lists_every_corpus_entry():
    doc = (REPO_ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert "python bench/corpus_table.py" in doc
    missing = [e["id"] for e in load() if e["id"] not in doc]
    assert not missing


@pytest.mark.parametrize("run", [
    "llama3-70b-gpu-hours",
    pytest.param("llama2-70b-gpu-hours", marks=pytest.mark.xfail(strict=True, reason=(
        "+27%: Meta's figure implies 46% MFU on A100, above the 43% hardware utilisation assumed for our stack; the "
        "plan (ZeRO-3, AutoTP 8, every:4 recompute) loses 8% to recompute and 9% to AutoTP's all-reduces. Pipelines "
        "do not beat it on 2,048 GPUs with half a sequence each: TP 8 x PP 2 runs 8 micro-batches (bubble 1/9) and "
        "its stage all-reduce is exposed, 0.316 MFU against 0.361"))),
])
def test_meta_70b_gpu_hours_within_20_percent_with_pipelines_searched(predictions, run):
    p = next(p for p in predictions if p.id == run)
    _, published, predicted, err = figure(p, "GPU-hours")
    assert abs(err) <= 0.20, (run, published, predicted)


def test_405b_on_deepspeeds_pipeline_at_metas_layout(predictions):
    """Meta's own layout, TP 8 x PP 16 x DP 64, on DeepSpeed's pipeline engine: it plans, and the planner's own
    choice is at least as fast. Its GPU-hours are far from the published: see REASON_405B."""
    from dataclasses import replace

    from adaptive.plan.search.planner import fit

    free = next(p for p in predictions if p.id == "llama3.1-405b-gpu-hours")
    req = replace(free.plan.request, tp_size=8, pp_size=16)
    plan = fit(req, suggest=False)
    s = plan.shown.setup
    assert plan.fits and (s.tp_size, s.pp_size, s.dp_size, plan.shown.grad_accum) == (8, 16, 64, 32)
    assert free.plan.shown.throughput.tokens_per_second >= plan.shown.throughput.tokens_per_second
    hours = free.entry["knobs"]["train_tokens"] / plan.shown.throughput.tokens_per_second * req.world_size / 3600
    err = hours / free.entry["outcome"]["gpu_hours"] - 1
    assert 0.3 < err < 1.5  # +108% today: the bubble (15/47) and full recompute; a model that fixed either would move it
