"""Pipeline parallelism as DeepSpeed's pipeline engine runs it (adaptive/plan/estimate/pipeline.py)."""

import json

import pytest

from adaptive.errors import AdaptiveError
from adaptive.plan import fit, make_request
from adaptive.plan.architecture.params import count_params
from adaptive.plan.ds_config.emit import plan_dict
from adaptive.plan.ds_config.reader import merge_pp_pin, parse
from adaptive.plan.estimate.pipeline import in_flight, partition
from tests.conftest import REPO_ROOT

LLAMA_405B = str(REPO_ROOT / "tests" / "plan" / "data" / "llama-3.1-405b" / "config.json")


def one_replica(pp: int, micro_batches: int):
    """b1 as pp stages on pp GPUs of one node: one replica, so no gradient all-reduce to blur the schedule."""
    return fit(make_request(model="b1", gpu="h100-80gb", gpus=pp, pp_size=pp, micro_batch=1,
                            grad_accum=micro_batches, zero=1), suggest=False)


def test_fewer_micro_batches_per_step_cost_tokens_per_second_by_the_1f1b_bubble():
    p = 4
    plans = {m: one_replica(p, m) for m in (2, 4, 16)}
    for m, plan in plans.items():
        assert plan.fits and plan.shown.setup.pp_size == p and plan.shown.grad_accum == m
        assert plan_dict(plan)["pipeline_bubble_fraction"] == pytest.approx((p - 1) / (m + p - 1))
    # a step is (m + p - 1) slots of one micro-batch on the slowest stage, then the stage's gradient all-reduce and
    # its optimizer step: the slot, (step - all-reduce - optimizer) / (m + p - 1), is the same at every m, and the
    # bubble is (p - 1) of them
    speed = {m: plan.shown.throughput.tokens_per_second for m, plan in plans.items()}
    assert speed[2] < speed[4] < speed[16]
    slots = {}
    for m, plan in plans.items():
        t = plan.shown.throughput
        assert t.optimizer_seconds > 0
        slots[m] = (t.step_seconds - t.comm_seconds - t.optimizer_seconds) / (m + p - 1)
        assert t.pipeline_bubble_seconds == pytest.approx((p - 1) * slots[m], rel=1e-9)
    assert slots[2] == pytest.approx(slots[16], rel=1e-9) and slots[4] == pytest.approx(slots[16], rel=1e-9)


def test_stages_split_by_parameters_and_the_first_holds_p_micro_batches():
    from adaptive.plan.request import resolve_model

    spec = resolve_model(LLAMA_405B)
    stages = partition(spec, 16)
    # 126 blocks of 3.24B; the embedding and the head (2.1B each) take one block's place on the end stages
    assert [st.blocks for st in stages] == [7] + [8] * 14 + [7]
    assert stages[0].embedding and stages[-1].head and not any(st.embedding or st.head for st in stages[1:-1])
    assert sum(st.params for st in stages) == count_params(spec).total  # untied: every weight once
    assert [in_flight(s, 16, 32) for s in (0, 1, 15)] == [16, 15, 1]
    assert in_flight(0, 16, 4) == 4  # never more than the step's micro-batches


def test_a_tied_head_is_held_by_the_last_stage_too():
    from dataclasses import replace

    from adaptive.plan import preset_spec

    spec = replace(preset_spec("b1", "dense"), tie_word_embeddings=True)  # a TiedLayerSpec builds it on both ends
    stages = partition(spec, 2)
    assert sum(st.params for st in stages) == count_params(spec).total + spec.vocab_size * spec.hidden_size


def test_micro_batches_in_flight_multiply_a_stages_activations():
    # 4 stages of 8 b7 blocks: with one micro-batch per step each stage holds one (the last, with the head, peaks);
    # with 16, stage s holds 4 - s, and the first stage's 4 x 8 blocks peak
    one, many = (fit(make_request(model="b7", gpu="h100-80gb", gpus=4, pp_size=4, micro_batch=1, grad_accum=m,
                                  zero=1, checkpointing=False, seq_len=4096), suggest=False) for m in (1, 16))
    a1, a16 = (pl.shown.memory.parts["activations"] for pl in (one, many))
    assert 3.5 * a1 < a16 < 4 * a1
    assert one.shown.memory.parts["params"] == pytest.approx(many.shown.memory.parts["params"], rel=0.01)  # other stages


@pytest.mark.parametrize("pins_, needle", [
    (dict(zero=2), "refuses ZeRO-2 and ZeRO-3 (runtime/pipe/engine.py:76)"),
    (dict(zero=3), "refuses ZeRO-2 and ZeRO-3"),
    (dict(sp_size=2), "does not compose Ulysses SP with its pipeline engine"),
    (dict(zero_hpz=4, zero=3), "refuses ZeRO-2 and ZeRO-3"),
])
def test_what_the_pipeline_engine_refuses_is_one_line(pins_, needle):
    with pytest.raises(AdaptiveError, match="pp-size") as e:
        fit(make_request(model="b7", gpu="h100-80gb", gpus=8, pp_size=2, **pins_))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_more_stages_than_blocks_is_refused():
    with pytest.raises(AdaptiveError, match="must not exceed the decoder layers"):
        fit(make_request(model="debug", gpu="h100-80gb", gpus=8, pp_size=8))


def test_ds_config_pipeline_stages_pin_the_plan(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}}))
    plan = fit(make_request(model="b7", gpu="h100-80gb", gpus=8, ds_config=str(path)), suggest=False)
    assert plan.shown.setup.pp_size == 2
    ds = parse(json.loads(path.read_text()), str(path), 4096)
    assert merge_pp_pin(ds, None) == 2
    with pytest.raises(AdaptiveError, match="--pp-size 4 contradicts"):
        merge_pp_pin(ds, 4)


def test_405b_at_metas_layout_plans_and_the_free_choice_is_at_least_as_fast():
    kw = dict(model=LLAMA_405B, gpu="h100-80gb", gpus=8, nodes=1024, seq_len=8192, global_batch_tokens=16777216,
              tokens=15.6e12)
    pinned = fit(make_request(tp_size=8, pp_size=16, **kw), suggest=False)
    d = plan_dict(pinned)
    assert pinned.fits and d["pp_size"] == 16 and d["tp_size"] == 8 and d["dp_size"] == 64
    assert d["gradient_accumulation_steps"] == 32 and d["micro_batch_size"] == 1  # 2,048 sequences over 64 replicas
    assert d["pipeline_bubble_fraction"] == pytest.approx(15 / 47)
    free = fit(make_request(**kw), suggest=False)
    assert free.shown.throughput.tokens_per_second >= pinned.shown.throughput.tokens_per_second
