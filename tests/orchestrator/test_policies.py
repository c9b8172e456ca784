"""The policies' rules one by one, on hand-made signals: the monitor's arithmetic, the OOM ladder's rungs
(the shorter-sequence rung included), the guard's spike rule, the EP recommendation, the flags."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from adaptive.errors import AdaptiveError
from adaptive.orchestrator import POLICY_NAMES, OrchestratorConfig, orchestrator_config, policies
from adaptive.train.run.callbacks import Control, TrainerState
from adaptive.orchestrator.ep_advice import EPAdviceConfig, recommend_ep_size, valid_ep_sizes
from adaptive.orchestrator.events import EventLog
from adaptive.orchestrator.guard import GuardConfig, GuardPolicy
from adaptive.orchestrator.monitor import Monitor, MonitorConfig, Signals, load_entropy
from adaptive.orchestrator.oom import OOMConfig, OOMPolicy, next_rung, shorter_seq_len
from tests.orchestrator._harness import knobs


def stats(counts, dropped, skip=None, agree=None, entropy=None):
    return SimpleNamespace(router_stats=SimpleNamespace(
        expert_counts=torch.tensor(counts), dropped_fraction=torch.tensor(dropped),
        router_entropy=None if entropy is None else torch.tensor(entropy),
        mod_skip_rate=None if skip is None else torch.tensor(skip),
        mod_router_agreement=None if agree is None else torch.tensor(agree)))


def test_the_monitor_sums_micro_batches_on_the_device_and_summarises_the_window():
    monitor = Monitor(MonitorConfig(every=2))
    state = TrainerState(max_steps=4, knobs=knobs(), output_dir=None)
    control = Control()
    micro = [stats([[6, 2, 0, 0], [2, 2, 2, 2]], [0.25, 0.0], [0.5], [0.75], [0.5, 0.75]),
             stats([[2, 2, 0, 0], [4, 0, 2, 2]], [0.75, 0.0], [0.25], [1.0], [0.25, 0.75])]
    for step in (1, 2):
        monitor.on_step_start(state, control)
        for i, out in enumerate(micro):
            loss = torch.tensor(float("nan") if (step, i) == (2, 1) else 2.0 * step)
            monitor.on_backward_end(state, control, outputs=out, loss=loss, batch={})
        if step == 1:
            assert monitor.step_counts.tolist() == [[8, 4, 0, 0], [6, 2, 4, 4]], "this step's counts, on the device"
        state.step = step
        monitor.on_step_end(state, control, metrics=None)
    s = monitor.latest
    assert s.step == 2 and s.steps == 2 and s.micro_batches == 4
    assert s.expert_counts == [[16, 8, 0, 0], [12, 4, 8, 8]]
    assert s.max_vio == [pytest.approx((16 - 6) / 6), pytest.approx((12 - 8) / 8)]
    assert s.dead_experts == [2, 0]
    assert s.load_entropy[0] == pytest.approx(-(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3)) / math.log(4))
    assert s.router_entropy == pytest.approx([0.375, 0.75]), "the model's per-token entropy, averaged"
    assert s.dropped_fraction == pytest.approx([0.5, 0.0]) and s.mod_skip_rate == pytest.approx([0.375])
    assert s.mod_router_agreement == pytest.approx([0.875])
    assert s.loss == pytest.approx((2 + 2 + 4) / 3) and s.non_finite == 1, "the NaN micro-batch is counted apart"
    assert load_entropy([5, 5, 5, 5]) == pytest.approx(1.0)


def test_router_entropy_is_the_mean_per_token_gate_entropy_not_the_load_entropy():
    from adaptive.models.moe import route

    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [8.0, 0.0, 0.0, 0.0], [8.0, 0.0, 0.0, 0.0]])
    stats_ = route(logits, 1, None, 1).stats
    probs = logits.softmax(-1)
    by_hand = (-(probs * probs.log()).sum(-1)).mean() / math.log(4)
    assert stats_.gate_entropy.item() == pytest.approx(by_hand.item(), rel=1e-5)
    assert stats_.expert_counts.tolist() == [4, 0, 0, 0], "every token picks expert 0: load entropy 0"
    assert stats_.gate_entropy.item() > 0.5, "yet the two undecided tokens keep the per-token entropy high"
    used = torch.tensor([True, True, False, False])  # padding is left out
    assert route(logits, 1, None, 1, used=used).stats.gate_entropy.item() == pytest.approx(1.0, rel=1e-5)


def test_a_failed_try_does_not_count_twice():
    monitor = Monitor(MonitorConfig(every=1))
    state = TrainerState(max_steps=1, knobs=knobs(), output_dir=None)
    control = Control()
    monitor.on_step_start(state, control)
    monitor.on_backward_end(state, control, outputs=stats([[4, 0]], [0.0]), loss=torch.tensor(1.0), batch={})
    monitor.on_oom(state, control, error=torch.OutOfMemoryError())
    monitor.on_backward_end(state, control, outputs=stats([[1, 3]], [0.0]), loss=torch.tensor(1.0), batch={})
    state.step = 1
    monitor.on_step_end(state, control, metrics=None)
    assert monitor.latest.expert_counts == [[1, 3]] and monitor.latest.micro_batches == 1


@pytest.mark.parametrize("micro, accum, expected", [
    (8, 2, ("halve_micro_batch", {"micro_batch_size": 4, "gradient_accumulation_steps": 4})),
    (3, 1, ("halve_micro_batch", {"micro_batch_size": 1, "gradient_accumulation_steps": 3})),
    (6, 1, ("halve_micro_batch", {"micro_batch_size": 3, "gradient_accumulation_steps": 2})),
    (1, 4, ("enable_checkpointing", {"checkpoint_policy": "every:4"})),
])
def test_each_rung_keeps_the_global_batch(micro, accum, expected):
    k = knobs(micro=micro, accum=accum)
    action, changes = next_rung(k, OOMConfig())
    assert (action, changes) == expected
    assert k.changed(changes).samples_per_step == k.samples_per_step


def test_at_micro_batch_1_each_oom_checkpoints_more_in_the_planners_order_then_halves_the_sequence():
    config = OOMConfig(min_seq_len=32)
    k, actions = knobs(micro=1, accum=4, seq=64), []
    while (rung := next_rung(k, config)) is not None:
        actions.append((rung[0], k.changed(rung[1]).checkpoint_policy))
        k = k.changed(rung[1])
    assert actions == [("enable_checkpointing", "every:4"), ("raise_checkpointing", "every:2"),
                       ("raise_checkpointing", "mlp"), ("raise_checkpointing", "full"), ("halve_seq_len", "full")]
    assert k.gradient_checkpointing and k.samples_per_step == knobs(micro=1, accum=4, seq=64).samples_per_step
    # a run that starts on a policy moves on from it; one outside the ladder goes to full
    assert next_rung(knobs(micro=1).changed({"checkpoint_policy": "every:2"}), config)[1] == {"checkpoint_policy": "mlp"}
    assert next_rung(knobs(micro=1).changed({"checkpoint_policy": "every:3"}), config)[1] == {"checkpoint_policy": "full"}
    assert next_rung(knobs(micro=1), OOMConfig(checkpoint_ladder=["full"]))[1] == {"checkpoint_policy": "full"}
    assert next_rung(knobs(micro=1), OOMConfig(checkpointing=False)) is None


def test_the_checkpoint_policy_knob_and_the_on_off_flag_agree():
    k = knobs(micro=1)
    assert (k.checkpoint_policy, k.gradient_checkpointing) == ("off", False)
    assert k.changed({"gradient_checkpointing": True}).checkpoint_policy == "full"
    assert k.changed({"checkpoint_policy": "every:1"}).checkpoint_policy == "full"
    mlp = k.changed({"checkpoint_policy": "mlp"})
    assert not mlp.gradient_checkpointing and mlp.changed({"gradient_checkpointing": False}).checkpoint_policy == "off"
    with pytest.raises(AdaptiveError, match="checkpointing policy must be off, full, mlp or every:N"):
        k.changed({"checkpoint_policy": "attention"})
    with pytest.raises(ValueError, match="checkpoint_ladder must end with full"):
        OOMConfig(checkpoint_ladder=("mlp",))
    with pytest.raises(ValueError, match="checkpoint_ladder: checkpointing policy must be"):
        OOMConfig(checkpoint_ladder=("every:0", "full"))


def test_the_last_rung_halves_the_sequence_live_and_keeps_the_blocks_of_the_step():
    k = knobs(micro=1, accum=8, seq=2048).changed({"gradient_checkpointing": True})
    assert next_rung(k, OOMConfig()) is None, "no min_seq_len: no shorter sequence"
    action, changes = next_rung(k, OOMConfig(min_seq_len=1024))
    assert (action, changes) == ("halve_seq_len", {"seq_len": 1024, "gradient_accumulation_steps": 16})
    short = k.changed(changes)
    assert (short.block_len, short.pieces_per_block, short.samples_per_step) == (2048, 2, 8)
    assert short.tokens_per_step == k.tokens_per_step == 8 * 2048
    assert next_rung(short, OOMConfig(min_seq_len=1024)) is None, "1024 is the floor"
    assert shorter_seq_len(short, 256) == 512 and shorter_seq_len(short, 513) is None
    assert shorter_seq_len(knobs(micro=1, seq=96), 16) == 48 and shorter_seq_len(knobs(micro=1, seq=48), 16) == 24
    three = knobs(micro=1, accum=3, seq=96).changed({"seq_len": 32, "gradient_accumulation_steps": 9})
    assert shorter_seq_len(three, 8) == 16, "16 still divides the block of 96"
    with pytest.raises(AdaptiveError, match=r"seq_len \(40\) must divide the block length \(2048\); nearest: 32"):
        k.changed({"seq_len": 40})
    with pytest.raises(AdaptiveError, match="must be a multiple of the pieces per block"):
        k.changed({"seq_len": 1024, "gradient_accumulation_steps": 3})  # 3 pieces: one and a half blocks


def test_the_oom_policy_records_the_sequence_change_and_asks_for_a_retry():
    k = knobs(micro=1, accum=4, seq=64).changed({"gradient_checkpointing": True})
    state = TrainerState(max_steps=10, knobs=k, output_dir=None, step=3)
    control = Control()
    policy = OOMPolicy(EventLog(), OOMConfig(min_seq_len=32))
    policy.on_oom(state, control, error=torch.OutOfMemoryError("CUDA out of memory"))
    assert control.retry_step and control.change_knobs == {"seq_len": 32, "gradient_accumulation_steps": 8}
    event = policy.events.decisions[-1]
    assert (event["step"], event["action"]) == (4, "halve_seq_len")
    assert event["before"] == {"micro_batch_size": 1, "gradient_accumulation_steps": 4, "gradient_checkpointing": True,
                               "checkpoint_policy": "full", "seq_len": 64}
    assert event["after"] == {**event["before"], "seq_len": 32, "gradient_accumulation_steps": 8}
    state.knobs = k.changed(control.change_knobs)
    exhausted = Control()
    policy.on_oom(state, exhausted, error=torch.OutOfMemoryError())
    assert not exhausted.retry_step and policy.events.decisions[-1]["action"] == "exhausted"
    assert "min_seq_len 32" in policy.events.decisions[-1]["reason"]


def test_the_guard_counts_a_spike_against_the_median_and_lowers_the_lr_without_a_checkpoint():
    monitor = Monitor()
    guard = GuardPolicy(monitor, EventLog(), GuardConfig(bad_steps=2, window=10, spike_ratio=2.0, min_history=3,
                                                         lr_factor=0.25, lr_steps=4))
    state = TrainerState(max_steps=100, knobs=knobs(), output_dir=None)
    actions = []
    for step, loss in enumerate([3.0, 3.1, 2.9, 3.0, 7.0, 3.0, 6.5], start=1):
        state.step = step
        monitor.latest = Signals(step=step, steps=1, micro_batches=1, loss=loss)
        control = Control()
        guard.on_step_end(state, control, metrics={})
        actions.append((control.lr_scale, control.rollback_to_checkpoint))
    assert [(e["step"], e["action"]) for e in guard.events.decisions] == [(5, "spike"), (7, "spike"), (7, "lower_lr")]
    assert actions[-1] == (0.25, False), "no checkpoint: lower the LR only"
    for step in (8, 9, 10, 11):
        state.step = step
        monitor.latest = Signals(step=step, steps=1, micro_batches=1, loss=3.0)
        control = Control()
        guard.on_step_end(state, control, metrics={})
    assert control.lr_scale == 1.0 and guard.events.decisions[-1]["action"] == "restore_lr"


def test_the_guard_stops_after_max_rollbacks(tmp_path):
    guard = GuardPolicy(Monitor(), EventLog(), GuardConfig(bad_steps=1, max_rollbacks=1))
    state = TrainerState(max_steps=100, knobs=knobs(), output_dir=tmp_path,
                         last_checkpoint=tmp_path / "checkpoints" / "step_00000010", last_checkpoint_step=10)
    outcomes = []
    for step in (12, 13):
        state.step, state.last_skip = step, "discarded"
        control = Control()
        guard.on_step_end(state, control, metrics=None)
        outcomes.append((control.rollback_to_checkpoint, control.should_stop))
    assert outcomes == [(True, False), (False, True)]
    assert guard.events.decisions[1]["after"]["step"] == 10


def test_ep_advice_follows_the_all_to_all_share():
    from adaptive.plan import fit, make_request

    config = EPAdviceConfig()
    # pinned to the launch being advised (ep 8, micro-batch 8), whatever layout the planner would pick today
    plan = fit(make_request(model="b1", arch="moe", gpu="h100", gpus=8, micro_batch=8, ep_size=8), suggest=False)
    assert valid_ep_sizes(8, 8) == [1, 2, 4, 8] and valid_ep_sizes(8, 6) == [1, 2]
    high = recommend_ep_size(8, 8, 8, 0.6, 0.2, plan, config)
    assert high.ep_size == 4 and "all-to-all 60.0%" in high.reason and "--ep-size 4" in high.command
    assert recommend_ep_size(4, 8, 8, 0.1, 0.2, plan, config).ep_size == 4  # keep
    uneven = recommend_ep_size(4, 8, 8, 0.1, 2.5, plan, config)
    assert uneven.ep_size == 4 and "MaxVio 2.50" in uneven.reason
    assert recommend_ep_size(1, 8, 8, None, None, None, config).ep_size == 1


def test_policies_are_chosen_and_configured_by_flags():
    chain = policies()
    assert [c.name for c in chain] == ["monitor", *POLICY_NAMES, "summary"]
    config = orchestrator_config("guard,balance", '{"guard": {"bad_steps": 5}, "balance": {"rate": 0.002}}')
    chain = policies(config)
    assert [c.name for c in chain] == ["monitor", "balance", "guard", "summary"]
    assert chain[2].config.bad_steps == 5 and chain[1].config.rate == 0.002 and chain[2].config.window == 50
    assert [c.name for c in policies(orchestrator_config("none"))] == ["monitor", "summary"]
    assert OrchestratorConfig().policies == POLICY_NAMES
    with pytest.raises(AdaptiveError, match="unknown orchestrator policy 'gaurd'; did you mean guard"):
        orchestrator_config("gaurd")
    with pytest.raises(AdaptiveError, match="unknown balance setting 'u'"):
        orchestrator_config(None, '{"balance": {"u": 0.1}}')
    with pytest.raises(AdaptiveError, match="neither a JSON object nor a file"):
        orchestrator_config(None, "nowhere.json")


def test_no_host_sync_between_log_steps():
    """Every policy runs on meta tensors (a tensor that has no values): any read to the host (.item(),
    .tolist(), bool()) would raise. Between log steps nothing reads; the log step's one summary does."""
    from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM

    with torch.device("meta"):
        model = AdaptiveForCausalLM(AdaptiveConfig.from_preset("debug", arch="hybrid"))
    gates = model.moe_gates()
    outputs = SimpleNamespace(router_stats=SimpleNamespace(
        expert_counts=torch.zeros(len(gates), 8, dtype=torch.long, device="meta"),
        dropped_fraction=torch.zeros(len(gates), device="meta"), mod_skip_rate=torch.zeros(2, device="meta"),
        mod_router_agreement=torch.zeros(2, device="meta")))
    chain = policies()
    from adaptive.train.run.callbacks import CallbackList

    callbacks = CallbackList(chain)
    state = TrainerState(max_steps=100, knobs=knobs(), output_dir=None, model=model)
    control = Control()
    callbacks.on_train_start(state, control)
    for step in range(1, 4):
        callbacks.on_step_start(state, control)
        for _ in range(2):
            callbacks.on_backward_end(state, control, outputs=outputs, loss=torch.zeros((), device="meta"), batch={})
        callbacks.on_optimizer_step(state, control)
        state.step = step
        callbacks.on_step_end(state, control, metrics=None)
    assert chain[1].updates == 3, "the balancing update ran every step, on the device"
    callbacks.on_step_start(state, control)
    callbacks.on_backward_end(state, control, outputs=outputs, loss=torch.zeros((), device="meta"), batch={})
    state.step = 4
    with pytest.raises(Exception, match="meta"):  # the log step's summary reads the window once
        callbacks.on_step_end(state, control, metrics={})
