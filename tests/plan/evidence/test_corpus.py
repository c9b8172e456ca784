"""`fit` against published runs (adaptive/plan/evidence/corpus_runs.json): the done-when criteria of issue 10.

Every entry is planned with the knobs its source states; the outcome must match within the stated
tolerances where the run's stack is the kind `fit` models, and the error is shown (docs/BENCHMARKS.md,
bench/corpus_table.py) everywhere else.
"""

import pytest

from adaptive.plan.evidence.corpus import (CONSUMER_TOLERANCE, GPU_HOURS_TOLERANCE, LARGE_GPU_HOURS_RUNS,
                                           LARGE_GPU_HOURS_TOLERANCE, SPEED_TOLERANCE,
                                           comparisons, implied_stack_efficiency, is_dense_up_to_13b, load, predict)
from adaptive.plan.search.tight import (DEFAULT_HEADROOM, DEFAULT_HEADROOM_FRACTION, NO_HEADROOM, TIGHT_MARGIN,
                                       headroom_from_underpredictions)
from tests.conftest import REPO_ROOT

GiB = 2**30

REASON_405B = (
    "+45%: at sequence 8192 a 405B layer stack fits 80 GB under AutoTP only with full recompute (AutoTP keeps 10/34 "
    "of a layer's activations whole: no Megatron sequence parallel), which costs a third more compute, and AutoTP "
    "keeps every norm whole on each TP rank; Meta's TP 8 x PP 16 ran at 38-43%. DeepSpeed's pipeline does not close the gap: its "
    "non-interleaved 1F1B at 32 micro-batches over 16 stages idles 15/47 of the step, and the first stages, holding "
    "up to 16 micro-batches, need full recompute too (test_405b_on_deepspeeds_pipeline_at_metas_layout)")
REASON_LLAMA2_70B = (
    "+35% at 2,048 GPUs (the LLaMA-65B count; Meta does not state Llama 2's): with half a sequence per GPU the best "
    "DeepSpeed plan is ZeRO-3 + Ulysses SP 2 + ZeRO++, and 1.4 s of its 8.5 s step are parameter gathers over "
    "InfiniBand that 2,048 tokens of compute per GPU cannot hide, plus every:4 recompute; the same model on 256-1,024 "
    "GPUs (the 16K-tokens-per-GPU rule of the 7B and 13B rows) plans at +15%. Meta's stack (TP 8 with sequence "
    "parallelism under FSDP) gathers an eighth as much per GPU")
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
    "llama3-70b-gpu-hours",
    pytest.param("llama2-70b-gpu-hours", marks=pytest.mark.xfail(strict=True, reason=REASON_LLAMA2_70B)),
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


def speed_error(p) -> float | None:
    f = figure(p, "tokens/s per GPU") or figure(p, "TFLOP/s per GPU")
    return None if f is None else f[3]


def test_every_deepspeed_and_megatron_deepspeed_run_within_15_percent_step_time(predictions):
    """Issue 33: runs on DeepSpeed (transformers models, ZeRO) and Megatron-DeepSpeed (3D parallel, pipeline engine),
    planned with the per-operation model; tokens/s where published, else TFLOP/s per GPU."""
    rows = [(p.id, speed_error(p)) for p in predictions if p.entry["stack_kind"] in ("ours", "deepspeed-megatron")
            and "speed" not in p.entry.get("exempt", {})]
    rows = [(i, e) for i, e in rows if e is not None]
    assert len(rows) >= 14 and any(i.startswith("mt-nlg") for i, _ in rows) and any(i.startswith("bloom") for i, _ in rows)
    assert all(abs(e) <= SPEED_TOLERANCE for _, e in rows), rows


@pytest.mark.parametrize("run", [
    "llama2-7b-gpu-hours", "llama2-13b-gpu-hours",
    pytest.param("llama2-70b-gpu-hours", marks=pytest.mark.xfail(strict=True, reason=REASON_LLAMA2_70B)),
])
def test_llama2_gpu_hours_within_15_percent(predictions, run):
    p = next(p for p in predictions if p.id == run)
    _, published, predicted, err = figure(p, "GPU-hours")
    assert abs(err) <= GPU_HOURS_TOLERANCE, (run, published, predicted)


def test_consumer_gpu_runs_within_20_percent(predictions):
    rows = [(p.id, p.entry["gpu"], speed_error(p)) for p in predictions if p.entry["category"] == "Consumer GPUs"
            and "speed" not in p.entry.get("exempt", {})]
    assert {g for _, g, _ in rows} >= {"rtx4090-24gb", "rtx3090-24gb", "t4-16gb"}
    assert all(abs(e) <= CONSUMER_TOLERANCE for _, _, e in rows), rows


def test_stack_efficiencies_are_what_their_reference_runs_imply(predictions):
    """op_times.STACKS: eager is the median over the gist's 8 HF + DeepSpeed runs, fused is BLOOM-176B's; the other
    runs of each stack check them (the tolerance tests above)."""
    from adaptive.plan.estimate.op_times import STACKS

    by_id = {p.id: p for p in predictions}
    gist = sorted(implied_stack_efficiency(p) for i, p in by_id.items() if i.startswith("gist-llama7b"))
    assert len(gist) == 8
    assert STACKS["eager"].efficiency == pytest.approx((gist[3] + gist[4]) / 2, abs=0.005)
    assert STACKS["fused"].efficiency == pytest.approx(implied_stack_efficiency(by_id["bloom-176b-384xa100"]), abs=0.005)
    # compiled single-node runs sustain their kernels' benchmark speed: nanoGPT on a 4090 runs at 1.05 of it
    assert implied_stack_efficiency(by_id["nanogpt-gpt2-124m-1xrtx4090"]) == pytest.approx(
        STACKS["compiled"].efficiency, abs=0.08)


def test_tight_margin_is_the_largest_peak_underprediction_on_our_stack(predictions):
    errors = [figure(p, "peak GiB")[3] for p in predictions
              if p.entry["stack_kind"] == "ours" and figure(p, "peak GiB") and "peak" not in p.entry.get("exempt", {})]
    worst_under = -min(errors)
    assert worst_under > 0
    assert TIGHT_MARGIN == pytest.approx(worst_under, abs=0.005)


def test_default_headroom_is_the_largest_peak_underprediction_on_our_stack_rounded_up(predictions):
    rows = [(p, figure(p, "peak GiB")) for p in predictions
            if p.entry["stack_kind"] == "ours" and figure(p, "peak GiB") and "peak" not in p.entry.get("exempt", {})]
    # each row's under-prediction, from the published and predicted peaks themselves
    worst = max((published - predicted) / published for _, (_, published, predicted, _) in rows)
    assert 0.12 < worst < 0.13  # gist-llama7b-a800-z3-mb2-gb64: 75.7 GiB measured, 66.1 predicted
    assert DEFAULT_HEADROOM_FRACTION == headroom_from_underpredictions(f[3] for _, f in rows) == 0.13
    assert DEFAULT_HEADROOM.fraction == DEFAULT_HEADROOM_FRACTION
    # a plan keeping that fraction free stays in memory at the worst row's measured/predicted ratio
    assert (1 - DEFAULT_HEADROOM_FRACTION) / (1 - worst) <= 1


def test_the_corpus_checks_its_predictions_against_the_whole_gpu(predictions):
    """The fit/OOM calls check the prediction, not the safety margin: the corpus plans at headroom 0. Every run of
    our stack that ran would also fit with the default headroom kept free."""
    assert all(p.plan.request.headroom == NO_HEADROOM and p.plan.headroom_bytes == 0 for p in predictions)
    ran = [p for p in predictions if p.entry["stack_kind"] == "ours" and p.entry["outcome"].get("ran")]
    capacity = {p.id: p.plan.request.gpu.memory_bytes for p in ran}
    assert all(p.peak_gib * GiB <= (1 - DEFAULT_HEADROOM_FRACTION) * capacity[p.id] for p in ran)


def test_benchmarks_doc_lists_every_corpus_entry():
    doc = (REPO_ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert "python bench/corpus_table.py" in doc
    missing = [e["id"] for e in load() if e["id"] not in doc]
    assert not missing


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
    assert 0.3 < err < 2.0  # +166% today: the bubble (15/47), full recompute and AutoTP's whole norms per TP rank
