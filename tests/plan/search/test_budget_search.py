"""The budget search: the plan with the lowest predicted loss that a budget buys, checked against brute force."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from adaptive.errors import AdaptiveError
from adaptive.plan import fit, make_request
from adaptive.plan.quality.hyperparams import optimal_batch_tokens
from adaptive.plan.quality.predict import predict
from adaptive.plan.search.budget import (MIN_STEPS, Budget, batch_for_flops, budget_flops, global_batch_for,
                                         ladder_specs, search_budget)


def _brute_force(req, budget: Budget):
    """Every rung of the ladder as every arch, planned at the search's own batch: the lowest loss bought."""
    hours = budget.hours(req.world_size, req.gpu.price_per_hour)
    best = None
    for specs in ladder_specs(vocab_size=32000).values():
        for spec in specs:
            plan = fit(replace(req, spec=spec, train_tokens=None,
                               global_batch_tokens=batch_for_flops(budget_flops(req, hours), req.seq_len,
                                                                   req.world_size)), suggest=False)
            if not plan.fits:
                continue
            tokens = plan.shown.throughput.tokens_per_second * hours * 3600
            if tokens < MIN_STEPS * plan.global_batch_tokens:
                continue
            loss = predict(spec, plan.counts, tokens).predicted_loss
            if best is None or loss < best[0]:
                best = (loss, spec.name, spec.arch)
    return best


@pytest.mark.parametrize("gpu,gpus,usd", [("rtx4090-24gb", 1, 50.0), ("a100-80gb", 8, 2000.0)])
def test_the_search_finds_what_planning_every_rung_finds(gpu, gpus, usd):
    req = make_request(model="b1", gpu=gpu, gpus=gpus)
    result = search_budget(req, Budget(usd=usd))
    loss, name, arch = _brute_force(req, Budget(usd=usd))
    chosen = [p for p in result.by_arch if p.request.spec.arch == arch][0]
    assert chosen.request.spec.name == name
    # the winner is re-planned at its own compute's batch, which may only lower its loss a little further
    assert result.best.quality.predicted_loss <= loss + 0.005
    assert result.planned < sum(len(v) for v in ladder_specs().values()) / 2  # and it planned far fewer


def test_each_arch_spends_the_budget_and_the_winner_has_the_lowest_loss():
    req = make_request(model="b1", gpu="a100-80gb", gpus=8)
    result = search_budget(req, Budget(usd=2000))
    assert sorted(p.request.spec.arch for p in result.by_arch) == ["dense", "hybrid", "mod", "moe"]
    assert result.best is result.by_arch[0]
    assert result.best.quality.predicted_loss == min(p.quality.predicted_loss for p in result.by_arch)
    for p in result.by_arch:
        assert p.fits and p.cost == pytest.approx(2000, rel=1e-6)  # the tokens are what the budget buys at its speed
        assert p.train_tokens == pytest.approx(p.shown.throughput.tokens_per_second * result.hours * 3600, rel=1e-9)


def test_the_global_batch_is_deepseeks_b_opt_unless_pinned():
    req = make_request(model="b1", gpu="a100-80gb", gpus=8)
    best = search_budget(req, Budget(usd=2000)).best
    b_opt = global_batch_for(best.request.spec, best.train_tokens, 2048, 8)
    assert best.global_batch_tokens == b_opt
    seqs = optimal_batch_tokens(best.hyperparams.flops) / 2048
    assert abs(math.log2(b_opt / 2048) - math.log2(seqs)) <= 0.5  # a power of two, the nearest one
    pinned = search_budget(replace(req, global_batch_tokens=524288), Budget(usd=2000)).best
    assert pinned.global_batch_tokens == 524288


def test_limits_take_the_tightest_and_max_params_bounds_the_model():
    req = make_request(model="b1", gpu="a100-80gb", gpus=8)
    both = Budget(usd=2000, gpu_hours=100)
    assert both.hours(8, req.gpu.price_per_hour) == pytest.approx(100 / 8)
    assert Budget(days=2).hours(8, 1.0) == 48
    small = search_budget(req, Budget(usd=2000), max_params=5e8)
    assert all(p.counts.total <= 5e8 for p in small.by_arch)
    free = search_budget(req, Budget(usd=2000))
    assert small.best.quality.predicted_loss > free.best.quality.predicted_loss


def test_a_budget_that_buys_no_model_is_one_line():
    req = make_request(model="b1", gpu="a100-80gb", gpus=8)
    with pytest.raises(AdaptiveError, match="buys no model") as err:
        search_budget(req, Budget(usd=1e-4))  # a few milliseconds of 8 GPUs
    assert "\n" not in str(err.value)
    with pytest.raises(AdaptiveError, match="buys no model with at most 1e\\+06 parameters"):
        search_budget(req, Budget(usd=2000), max_params=1e6)  # below the smallest rung
    with pytest.raises(AdaptiveError, match="costs \\$0/hour"):
        search_budget(make_request(model="b1", gpu="a100-80gb", price=0.0), Budget(usd=10))


def test_the_loss_falls_as_the_budget_grows():
    req = make_request(model="b1", gpu="h100-80gb", gpus=8)
    losses = [search_budget(req, Budget(usd=usd)).best.quality.predicted_loss for usd in (100, 1000, 10000)]
    assert losses == sorted(losses, reverse=True)
    sizes = [search_budget(req, Budget(usd=usd)).best.counts.active for usd in (100, 10000)]
    assert sizes[0] < sizes[1]  # a larger budget buys a larger model, not only more tokens


def test_a_winner_at_the_end_of_the_ladder_is_said():
    req = make_request(model="b1", gpu="h100-80gb", gpus=8)
    assert not search_budget(req, Budget(usd=2000)).largest_tried
    capped = search_budget(req, Budget(usd=100000), max_params=1e9)
    assert capped.largest_tried and capped.best.counts.total <= 1e9
