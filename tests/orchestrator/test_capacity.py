"""Capacity adaptation under forced overflow: the debug MoE with its router skewed towards two experts
drops many routes at capacity factor 1.0; the policy raises the factor until the dropped fraction
is below the threshold, and never above the bound the planner's memory model gives for the budget.

Settings (stated): debug preset as MoE (5 MoE layers, 8 experts, top-2), 8 x 32 tokens per step,
summaries every 2 steps, patience 1, factor step 0.5 from 1.0 up to 4.0, threshold 2% dropped.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM
from adaptive.orchestrator import OrchestratorConfig, policies
from adaptive.orchestrator.capacity import CapacityConfig, capacity_bound, capacity_grid, planned_peak_bytes
from adaptive.plan import fit, make_request
from tests.orchestrator._harness import knobs, run_steps, skew

STEPS = 16
THRESHOLD = 0.02
SETTINGS = {"monitor": {"every": 2},
            "capacity": {"raise_above": THRESHOLD, "patience": 1, "step": 0.5, "min_factor": 1.0, "max_factor": 4.0}}


@pytest.fixture(scope="module")
def plan():
    # plain kernels: the activations, and so the peak, grow with every step of the capacity factor
    return fit(make_request(model="debug", arch="moe", gpu="t4", seq_len=32, micro_batch=8, grad_accum=1,
                            zero=0, offload="none", checkpointing=False, kernels="plain"), suggest=False)


def debug_moe():
    torch.manual_seed(0)
    model = AdaptiveForCausalLM(AdaptiveConfig.from_preset("debug", arch="moe", capacity_factor=1.0))
    skew(model)
    return model


def train(plan, budget: int | None, steps: int = STEPS):
    settings = {**SETTINGS, "capacity": {**SETTINGS["capacity"], "memory_budget_bytes": budget}}
    callbacks = policies(OrchestratorConfig(policies=("capacity",), settings=settings))
    model = debug_moe()
    data = torch.randint(0, 2048, (6, 8, 32), generator=torch.Generator().manual_seed(3))
    run = run_steps(model, callbacks, data, steps, plan=plan, knob_set=knobs(micro=8, seq=32))
    return model, callbacks, run


@pytest.fixture(scope="module")
def runs(plan):
    low = planned_peak_bytes(plan, knobs(micro=8, seq=32), 2.0)  # the budget that affords factor 2.0 and no more
    return {"roomy": train(plan, None), "low": train(plan, low, steps=8), "low_budget": low}


def decisions(callbacks):
    return [e for e in callbacks[-1].events.decisions if e["policy"] == "capacity"]


def test_the_bound_is_the_largest_factor_whose_planned_peak_fits(plan):
    k = knobs(micro=8, seq=32)
    config = CapacityConfig(**SETTINGS["capacity"])
    grid = capacity_grid(config)
    peaks = [planned_peak_bytes(plan, k, f) for f in grid]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1], "more capacity, more activation memory"
    # the optimizer step sets the peak at small factors; the first factor whose backward costs more:
    i = next(i for i in range(1, len(grid)) if peaks[i] > peaks[i - 1])
    assert capacity_bound(plan, k, dataclasses.replace(config, memory_budget_bytes=peaks[i])) == grid[i]
    assert capacity_bound(plan, k, dataclasses.replace(config, memory_budget_bytes=peaks[i] - 1)) == grid[i - 1]
    assert capacity_bound(plan, k, config) == 4.0  # a T4's 16 GB: the grid's top


def test_forced_overflow_raises_capacity_until_drops_fall_below_the_threshold(runs):
    model, callbacks, _ = runs["roomy"]
    monitor = callbacks[0]
    first, last = monitor.history[0], monitor.history[-1]
    print("dropped (worst layer) per summary:", [round(s.dropped_max, 3) for s in monitor.history])
    print("capacity decisions:", [(e["step"], e["before"]["capacity_factor"], e["after"]["capacity_factor"])
                                  for e in decisions(callbacks)])
    assert first.dropped_max > 0.2, "the skewed router overflows capacity 1.0"
    assert last.dropped_max < THRESHOLD
    raised = decisions(callbacks)
    assert raised and all(e["action"] == "raise_capacity" for e in raised)
    factor = raised[-1]["after"]["capacity_factor"]
    assert all(g.capacity_factor == factor for g in model.moe_gates()), "every layer's gate"
    assert 1.0 < factor <= 4.0


def test_a_low_memory_budget_caps_the_capacity_factor(runs):
    model, callbacks, _ = runs["low"]
    events = decisions(callbacks)
    factors = [e["after"]["capacity_factor"] for e in events if e["action"] == "raise_capacity"]
    print("capped run:", [(e["step"], e["action"], e["after"]["capacity_factor"]) for e in events])
    assert factors == [1.5, 2.0], "raised up to the bound, never above"
    capped = [e for e in events if e["action"] == "capped"]
    assert len(capped) == 1 and capped[0]["signals"]["bound"] == 2.0
    assert capped[0]["signals"]["dropped_max"] > THRESHOLD, "it still drops: the budget, not the need, stopped it"
    assert all(g.capacity_factor == 2.0 for g in model.moe_gates())
    plan = runs["low"][2].state.plan
    assert planned_peak_bytes(plan, knobs(micro=8, seq=32), 2.5) > runs["low_budget"], "2.5 would not fit"


def test_capacity_is_lowered_when_nothing_drops_and_memory_is_tight(plan):
    from adaptive.train.run.callbacks import Control, TrainerState
    from adaptive.orchestrator.capacity import CapacityPolicy
    from adaptive.orchestrator.events import EventLog
    from adaptive.orchestrator.monitor import Monitor, Signals

    model = debug_moe()
    for gate in model.moe_gates():
        gate.capacity_factor = 2.0
    k = knobs(micro=8, seq=32)
    tight = int(planned_peak_bytes(plan, k, 2.0) / 0.95)  # the planned peak is 95% of this budget
    policy = CapacityPolicy(Monitor(), EventLog(), CapacityConfig(patience=2, step=0.5, memory_budget_bytes=tight))
    state = TrainerState(max_steps=10, knobs=k, output_dir=None, plan=plan, model=model)
    policy.on_train_start(state, Control())
    for step in (1, 2, 3, 4):
        state.step = step
        policy.monitor.latest = Signals(step=step, steps=1, micro_batches=1, dropped_fraction=[0.0] * 5)
        policy.on_step_end(state, Control(), metrics={})
    events = policy.events.decisions
    assert [(e["step"], e["action"], e["after"]["capacity_factor"]) for e in events] == [
        (2, "lower_capacity", 1.5), (4, "lower_capacity", 1.0)]
    assert events[0]["signals"]["memory_source"] == "planned"
    assert all(g.capacity_factor == 1.0 for g in model.moe_gates())
    # with room to spare, nothing is lowered
    roomy = CapacityPolicy(Monitor(), EventLog(), CapacityConfig(patience=1, step=0.5))
    roomy.on_train_start(state, Control())
    roomy.monitor.latest = Signals(step=state.step, steps=1, micro_batches=1, dropped_fraction=[0.0] * 5)
    roomy.on_step_end(state, Control(), metrics={})
    assert not roomy.events.decisions
