"""Aux-loss-free balancing: a router initialised to send most tokens to experts 0 and 1 (tiny MoE, CPU,
fixed data) ends far better balanced with the selection bias than without, at no cost in loss; the
bias moves selection only; under torchrun with DeepSpeed MoE and ep_size=2 the same holds and the
biases stay bitwise identical on both ranks.

Settings (stated): 8 experts, top-2, 2 MoE layers, hidden 32, capacity factor 1.0, the model's
default aux loss (0.01) in both runs, AdamW lr 3e-3, 40 steps over 8 fixed batches of 8 x 32 tokens.
The bias rate is u = 0.01, not DeepSeek's 1e-3: the router scores are probabilities, and closing a
gap of ~0.5 between the favoured experts and the rest at 1e-3 per step takes hundreds of steps.
MaxVio is measured on the loads summed over the last 10 steps (the monitor's window).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adaptive.orchestrator import OrchestratorConfig, policies
from tests.orchestrator._harness import fixed_data, run_steps, skewed_moe

STEPS = 40
RATE = 0.01
LOSS_TOLERANCE = 0.05  # mean loss of the last 10 steps, balanced minus unbalanced
WORKER = Path(__file__).with_name("_ep_balance_worker.py")
REPO = Path(__file__).resolve().parents[2]


def orchestrate(balance: bool):
    config = OrchestratorConfig(policies=("balance",) if balance else (),
                                settings={"balance": {"rate": RATE}, "monitor": {"every": 10}})
    return policies(config)


def train(balance: bool):
    model = skewed_moe()
    callbacks = orchestrate(balance)
    run = run_steps(model, callbacks, fixed_data(1), STEPS)
    return model, callbacks[0], run


@pytest.fixture(scope="module")
def both():
    return {on: train(on) for on in (False, True)}


def test_the_skewed_router_sends_most_routes_to_two_experts(both):
    _, monitor, _ = both[False]
    first = monitor.history[0]  # steps 1-10
    for layer in first.expert_counts:
        assert (layer[0] + layer[1]) / sum(layer) > 0.6, layer
    assert first.max_vio_max > 2.0


def test_bias_balancing_cuts_max_vio_by_half_at_no_loss_cost(both):
    _, off, run_off = both[False]
    _, on, run_on = both[True]
    vio_off, vio_on = off.latest.max_vio_max, on.latest.max_vio_max  # steps 31-40
    print(f"MaxVio over steps 31-40: off {vio_off:.3f}, on {vio_on:.3f}; per layer off {off.latest.max_vio}, "
          f"on {on.latest.max_vio}")
    assert vio_on <= 0.5 * vio_off, (vio_on, vio_off)
    loss_off, loss_on = (sum(r.losses[-10:]) / 10 for r in (run_off, run_on))
    print(f"mean loss of steps 31-40: off {loss_off:.4f}, on {loss_on:.4f}")
    assert loss_on <= loss_off + LOSS_TOLERANCE, (loss_on, loss_off)


def test_the_bias_moved_against_the_load_and_only_changes_selection(both):
    model, _, _ = both[True]
    for gate in model.moe_gates():
        bias = gate.e_score_correction_bias
        assert bias[0] < 0 and bias[1] < 0, bias  # the favoured experts were pushed down
        assert (bias[2:] > bias[:2].max()).all(), bias
    # selection only: the combine weights come from the unbiased softmax
    from adaptive.models.moe import route

    torch.manual_seed(0)
    logits = torch.randn(16, 8)
    bias = torch.zeros(8)
    bias[3] = 10.0  # forces expert 3 into every token's top-2
    routes = route(logits, 2, None, 1, selection_bias=bias)
    assert (routes.experts == 3).any(dim=0).all()
    gates = logits.softmax(-1)
    first, second = routes.experts
    expected = gates.gather(1, first[:, None]).squeeze(1)
    expected = expected / (expected + gates.gather(1, second[:, None]).squeeze(1))
    assert torch.allclose(routes.weights[0], expected)


def test_balancing_decisions_record_max_vio_and_the_bias_ranges(both):
    model, monitor, run = both[True]
    decisions = run.callbacks[-1].events.decisions
    assert [e["step"] for e in decisions] == [10, 20, 30, 40]
    last = decisions[-1]
    assert (last["policy"], last["action"]) == ("balance", "bias_update")
    assert last["signals"]["max_vio"] == monitor.latest.max_vio
    bias = [g.e_score_correction_bias.tolist() for g in model.moe_gates()]
    assert last["after"]["bias_range"] == [[pytest.approx(min(b), rel=1e-6), pytest.approx(max(b), rel=1e-6)]
                                           for b in bias]
    assert last["signals"]["router_entropy"] == monitor.latest.router_entropy
    assert decisions[0]["before"]["bias_range"] == [[0.0, 0.0], [0.0, 0.0]]


@pytest.mark.slow  # two processes under torchrun
def test_ep_size_2_under_torchrun_balances_and_keeps_biases_identical(tmp_path):
    from tests.train._launch import free_port, launch_env

    env = launch_env(tmp_path)  # no rank variables, offline, one thread per process, ninja on PATH
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(WORKER), str(tmp_path), str(STEPS), str(RATE)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    r0, r1 = ranks
    print(json.dumps({k: r0[k] for k in ("max_vio_off", "max_vio_on", "loss_off", "loss_on", "a2a_share")}))
    assert r0["ep_size"] == 2 and r0["local_experts"] == 4, "each rank holds 4 of the 8 experts"
    assert r0["bias_on"] == r1["bias_on"] and r0["bias_bits_equal"] and r1["bias_bits_equal"]
    assert r0["max_vio_on"] == r1["max_vio_on"], "the monitor's loads are summed over both ranks"
    assert r0["max_vio_on"] <= 0.5 * r0["max_vio_off"], r0
    assert r0["loss_on"] <= r0["loss_off"] + LOSS_TOLERANCE, r0
    assert r0["bias_moved"], "the DeepSpeed gate's bias was updated"
    assert r0["a2a_share"] is not None and 0 < r0["a2a_share"] <= 1, "DeepSpeed's all-to-all timers were read"
