"""The isoFLOP grid: each point trains its budget, through shapes the planner counts; bad sweeps are refused."""

from __future__ import annotations

import pytest

from adaptive.errors import AdaptiveError
from adaptive.plan.architecture.params import count_params
from adaptive.plan.estimate.throughput import model_flops_per_token
from adaptive.scaling.grid import SweepSettings, candidates, plan_grid, spec_for


def settings(**kw) -> SweepSettings:
    base = dict(archs=("dense", "moe"), budgets=(1e11, 4e11), sizes=3, dataset="builtin", seq_len=128, seed=0,
                lr=3e-3, micro_batch=4, vocab_size=2048)
    return SweepSettings(**{**base, **kw})


def test_every_point_trains_its_budget_to_within_half_a_step():
    s = settings()
    points = plan_grid(s)
    assert len(points) == 2 * 2 * 3
    for p in points:
        assert abs(p.flops - p.budget) <= 0.5 * s.tokens_per_step * p.flops_per_token
        assert p.tokens == p.steps * s.tokens_per_step
    # smaller budgets first, both archs per budget: a sweep stopped early has every arch's small budgets
    assert [p.budget for p in points] == sorted(p.budget for p in points)
    assert {p.arch for p in points[:3]} == {"dense"} and {p.arch for p in points[3:6]} == {"moe"}


def test_a_point_s_params_and_flops_are_the_planner_s_counts_of_the_shape_it_builds():
    for arch in ("dense", "moe"):
        for c in candidates(arch, 2048, 128):
            spec = spec_for(arch, c.width, 2048, 128)
            assert c.params == count_params(spec).active
            assert c.total_params == count_params(spec).total
            assert c.flops_per_token == model_flops_per_token(spec, 128)
    moe = candidates("moe", 2048, 128)[0]
    assert moe.total_params > moe.params  # 8 experts, 2 active


def test_sizes_grow_with_the_budget_once_the_smallest_are_overtrained():
    small, big = (plan_grid(settings(archs=("dense",), budgets=b, sizes=3))[-3:] for b in ((1e11, 2e11), (1e11, 1e14)))
    assert max(p.params for p in big) > max(p.params for p in small)


@pytest.mark.parametrize("change, message", [
    (dict(budgets=(-1e11, 4e11)), "--budgets must be positive FLOP counts, got -1e+11"),
    (dict(budgets=(float("nan"), 4e11)), "--budgets must be positive"),
    (dict(budgets=(1e11,)), "--budgets needs at least 2 compute budgets"),
    (dict(sizes=1), "--sizes must be at least 2"),
    (dict(archs=("dense", "mooe")), "unknown --arch 'mooe'; did you mean moe?"),
    (dict(budgets=(1e3, 4e11)), "--budgets 1e+03 is too small for 3 dense sizes"),
])
def test_a_bad_sweep_is_one_line_naming_the_value(change, message):
    with pytest.raises(AdaptiveError) as err:
        plan_grid(settings(**change))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_seeds_repeat_every_shape_with_the_next_seed_and_an_old_sweep_reads_as_one_seed(tmp_path):
    from adaptive.scaling.runner import recipe_flags

    base = settings()
    one = plan_grid(base)
    two = plan_grid(settings(seeds=2, seed=7))
    assert len(two) == 2 * len(one)
    assert {p.name for p in two} == {p.name for p in one} | {p.name + "-s1" for p in one}
    assert {p.shape_name for p in two} == {p.name for p in one}
    seeds = {p.replica: recipe_flags(p, settings(seed=7), tmp_path / p.name) for p in two[:1] + two[-1:]}
    assert [flags[flags.index("--seed") + 1] for flags in seeds.values()] == ["7", "8"]
    old = {k: v for k, v in base.as_dict().items() if k not in ("seeds", "tokenizer", "text_field")}
    assert SweepSettings.from_dict(old) == base  # a sweep.json written before --seeds continues
