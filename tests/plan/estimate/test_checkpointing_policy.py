"""Selective activation checkpointing in the planner: a knob between off and full, pinnable, in the OOM
ladder, and recorded in plan.json."""

from __future__ import annotations

from dataclasses import replace

import pytest

from adaptive.errors import AdaptiveError
from adaptive.plan import make_request
from adaptive.plan.estimate.activations import SELECTIVE_POLICIES, activation_bytes
from adaptive.plan.ds_config.emit import plan_dict
from adaptive.plan.search.planner import fit
from adaptive.plan.architecture.presets import preset_spec
from adaptive.plan.estimate.throughput import recompute_fraction


def test_policies_order_memory_and_recompute_between_off_and_full():
    spec = preset_spec("b7", "dense")
    order = ["off", *SELECTIVE_POLICIES, "full"]
    saved = [activation_bytes(spec, 2048, 1, policy) for policy in order]
    assert saved == sorted(saved, reverse=True) and len(set(saved)) == len(saved), dict(zip(order, saved))
    recompute = [recompute_fraction(spec, policy) for policy in order]
    assert recompute == sorted(recompute) and recompute[0] == 0.0 and recompute[-1] == 1.0
    assert recompute_fraction(spec, "every:2") == 0.5  # 16 of 32 layers
    assert activation_bytes(spec, 2048, 1, True) == activation_bytes(spec, 2048, 1, "full")


def _b7_on(gpu_mem_gib: float, **kw):
    return make_request(model="b7", gpu="a100-80gb", gpu_mem_gib=gpu_mem_gib, gpus=8, micro_batch=4, zero=3, offload="none",
                        tp_size=1, sp_size=1, **kw)  # data parallel: model parallelism would let "off" fit


def test_the_planner_picks_a_selective_policy_where_off_does_not_fit_and_full_is_slower():
    off = fit(_b7_on(40, checkpointing=False), suggest=False)
    full = fit(_b7_on(40, checkpointing=True), suggest=False)
    assert not off.fits and full.fits  # the case where selective checkpointing has room to matter
    free = fit(_b7_on(40), suggest=False)
    chosen = free.shown.setup
    assert free.fits and chosen.checkpointing in SELECTIVE_POLICIES, chosen.checkpointing
    assert free.shown.throughput.tokens_per_second > full.shown.throughput.tokens_per_second
    d = plan_dict(free)
    assert d["checkpointing"] == chosen.checkpointing and d["gradient_checkpointing"] is False


def test_a_pinned_policy_is_kept_and_selective_excludes_off_and_full():
    pinned = fit(_b7_on(40, checkpoint_policy="every:2"), suggest=False)
    assert pinned.shown.setup.checkpointing == "every:2"
    selective = fit(_b7_on(200, checkpoint_policy="selective"), suggest=False)
    assert selective.shown.setup.checkpointing in SELECTIVE_POLICIES  # off would fit 200 GiB, but was not asked
    assert fit(_b7_on(200), suggest=False).shown.setup.checkpointing == "off"


def test_the_oom_ladder_goes_through_selective_before_full():
    plan = fit(make_request(model="b7", gpu="a100-40gb"), suggest=False)
    changes = [step.change for step in plan.ladder]
    full = next(i for i, c in enumerate(changes) if c == "+ gradient checkpointing")
    assert any("selective checkpointing" in c for c in changes[1:full]), changes


@pytest.mark.parametrize("bad", ["some", "every:0", "partial"])
def test_unknown_policy_is_refused(bad):
    with pytest.raises(AdaptiveError, match="--checkpoint-policy must be off, selective, full"):
        fit(_b7_on(40, checkpoint_policy=bad))


def test_a_policy_contradicting_the_boolean_pin_is_refused():
    with pytest.raises(AdaptiveError, match="contradicts"):
        fit(_b7_on(40, checkpoint_policy="mlp", checkpointing=True))


def test_the_plain_kernels_stay_plannable_and_need_more_memory():
    lean = fit(_b7_on(40, checkpointing=False), suggest=False).shown.memory
    plain = fit(replace(_b7_on(40, checkpointing=False), kernels="plain"), suggest=False).shown.memory
    assert plain.parts["activations"] > 1.5 * lean.parts["activations"]
    today = plain.parts["logits_and_loss"] + plain.parts["backward_transient"]  # 4NV + 8NV
    assert today > 4 * lean.parts["logits_and_loss"]  # one tile of logits and the head's gradients
