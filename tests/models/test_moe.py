"""MoE routing: DeepSpeed's gating math, the load-balancing loss by hand, both dispatchers, the selection bias,
and the DeepSpeed block against the native one."""

from __future__ import annotations

import math

import pytest
import torch
from _model_helpers import tiny_config, tiny_model

from adaptive.models import AdaptiveForCausalLM
from adaptive.models.moe import expert_capacity, route, to_deepspeed_layout


def random_logits(tokens: int, experts: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize(("tokens", "experts", "factor", "min_capacity"),
                         [(64, 8, 1.0, 4), (50, 4, 0.5, 2), (33, 8, 1.25, 0), (7, 8, 1.0, 4)])
def test_top2_routing_equals_deepspeed_top2gating(tokens, experts, factor, min_capacity):
    from deepspeed.moe.sharded_moe import top2gating

    logits = random_logits(tokens, experts, tokens)
    l_aux, capacity, _, indices, locations, gates, counts = top2gating(
        logits.clone(), factor, min_capacity, drop_tokens=True, top2_2nd_expert_sampling=False, sparse_routes=True)
    ours = route(logits, 2, factor, min_capacity)
    assert ours.capacity == int(capacity)
    assert torch.equal(ours.experts, indices.long())  # includes which routes were dropped (-1)
    assert torch.equal(ours.locations, locations.long())
    assert torch.equal(ours.weights, gates)
    assert torch.equal(ours.stats.l_aux, l_aux)
    assert torch.equal(ours.stats.expert_counts, counts)


def test_top1_routing_equals_deepspeed_top1gating_when_nothing_drops():
    from deepspeed.moe.sharded_moe import top1gating

    logits = random_logits(40, 8, 1)
    l_aux, capacity, _, indices, locations, gates, counts = top1gating(
        logits.clone(), 2.0, 4, None, None, True, False, None, True)
    ours = route(logits, 1, 2.0, 4)
    assert ours.stats.dropped_fraction.item() == 0.0
    assert ours.capacity == int(capacity)
    assert torch.equal(ours.experts, indices.long())
    assert torch.equal(ours.locations, locations.long())
    assert torch.equal(ours.weights, gates)
    torch.testing.assert_close(ours.stats.l_aux, l_aux)
    assert torch.equal(ours.stats.expert_counts, counts)


def test_top1_drops_in_token_order_up_to_capacity():
    # DeepSpeed picks which over-capacity tokens to keep by topk over ties (or randomly with RTS); we keep the first.
    logits = random_logits(64, 8, 2)
    ours = route(logits, 1, 1.0, 4)
    first = logits.argmax(dim=-1)
    for expert in range(8):
        tokens = (first == expert).nonzero().flatten()
        kept = tokens[ours.experts[0, tokens] >= 0]
        assert kept.tolist() == tokens[: ours.capacity].tolist()


def test_capacity_follows_deepspeed_formula():
    assert expert_capacity(64, 8, 1.0, 2, 4) == 16  # ceil(64 / 8 * 1.0 * 2)
    assert expert_capacity(10, 8, 1.0, 1, 4) == 4  # min_capacity floor
    assert expert_capacity(100, 8, 1.25, 2, 0) == 32  # ceil(31.25)


def test_load_balancing_loss_matches_a_hand_computation():
    # 4 tokens, 3 experts. First choices: experts 0, 0, 1, 2 -> ce = (2/4, 1/4, 1/4).
    rows = [[2.0, 1.0, 0.0], [1.0, 0.0, -1.0], [0.0, 3.0, 1.0], [0.5, 0.0, 2.5]]
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in rows]
    me = [sum(p[e] for p in probs) / 4 for e in range(3)]
    ce = [2 / 4, 1 / 4, 1 / 4]
    by_hand = sum(m * c for m, c in zip(me, ce)) / 3 * 3 * 3  # mean(me * ce) * E^2
    routes = route(torch.tensor(rows), 2, None, 0)
    assert routes.stats.l_aux.item() == pytest.approx(by_hand, rel=1e-6)
    # second choices are 1, 1, 2, 0 and do not enter ce
    assert routes.experts.tolist() == [[0, 0, 1, 2], [1, 1, 2, 0]]
    assert routes.stats.expert_counts.tolist() == [3, 3, 2]
    z_by_hand = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in rows) / 4
    assert routes.stats.z_loss.item() == pytest.approx(z_by_hand, rel=1e-6)


def test_selection_bias_changes_the_choice_but_not_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    plain = route(logits, 2, None, 0)
    biased = route(logits, 2, None, 0, selection_bias=torch.tensor([0.0, 0.0, 0.0, 1.0]))
    assert plain.experts[:, 0].tolist() == [0, 1]
    assert biased.experts[:, 0].tolist() == [3, 0]
    gates = logits.softmax(-1)[0]
    expected = torch.stack([gates[3], gates[0]]) / (gates[3] + gates[0])  # unbiased scores, renormalised
    torch.testing.assert_close(biased.weights[:, 0], expected)
    # l_aux uses the unbiased probabilities with the biased first choice
    torch.testing.assert_close(biased.stats.l_aux, (gates * torch.tensor([0, 0, 0, 1.0])).mean() * 16)


def test_slot_and_grouped_dispatch_agree_and_drop_the_same_tokens():
    model = tiny_model("moe", capacity_factor=0.5, eval_capacity_factor=0.5)
    block = model.model.layers[0].mlp
    x = torch.randn(3, 20, 32, generator=torch.Generator().manual_seed(3))
    block.train()
    slot_out, slot_stats = block(x)
    block.eval()
    grouped_out, grouped_stats = block(x)
    assert slot_stats.dropped_fraction.item() > 0.2
    torch.testing.assert_close(grouped_stats.dropped_fraction, slot_stats.dropped_fraction)
    torch.testing.assert_close(grouped_out, slot_out, rtol=1e-5, atol=1e-6)


def test_dropped_tokens_get_zero_moe_output():
    model = tiny_model("moe", capacity_factor=0.25)
    block = model.model.layers[0].mlp.train()
    x = torch.randn(1, 64, 32, generator=torch.Generator().manual_seed(4))
    out, _ = block(x)
    routes = block.gate(x.reshape(-1, 32))
    fully_dropped = (routes.experts < 0).all(dim=0)
    assert fully_dropped.any()
    assert out.reshape(-1, 32)[fully_dropped].abs().max() == 0


def test_eval_never_drops_by_default():
    model = tiny_model("moe", capacity_factor=0.25).eval()
    out = model(torch.randint(0, 128, (2, 32)))
    assert out.router_stats.dropped_fraction.max().item() == 0.0


@pytest.mark.parametrize("arch", ["moe", "hybrid"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_deepspeed_and_native_moe_give_the_same_logits(arch, mode):
    native = tiny_model(arch, drop_tokens=False)
    deepspeed = AdaptiveForCausalLM(tiny_config(arch, drop_tokens=False, moe_implementation="deepspeed"))
    deepspeed.setup_expert_parallel()  # process groups before the first forward
    deepspeed.load_state_dict(native.state_dict())  # the native (Mixtral) layout, converted on load
    native.train(mode == "train")
    deepspeed.train(mode == "train")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(6))
    a, b = native(ids, labels=ids), deepspeed(ids, labels=ids)
    assert a.router_stats.dropped_fraction.max().item() == 0.0
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.loss, a.loss)
    assert torch.equal(b.router_stats.expert_counts, a.router_stats.expert_counts)
    if mode == "train":
        a.loss.backward()
        b.loss.backward()
        # native gradients in DeepSpeed's names (the 3D expert tensors split per expert)
        grads = to_deepspeed_layout({n: p.grad for n, p in native.named_parameters() if p.grad is not None})
        compared = 0
        for name, p in deepspeed.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-7, msg=name)
                compared += "deepspeed_experts" in name
        assert compared > 0


def test_deepspeed_block_drops_like_the_native_one():
    native = tiny_model("moe", capacity_factor=0.5).train()
    deepspeed = AdaptiveForCausalLM(tiny_config("moe", capacity_factor=0.5, moe_implementation="deepspeed")).train()
    deepspeed.setup_expert_parallel()  # process groups before the first forward
    deepspeed.load_state_dict(native.state_dict())
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(8))
    a, b = native(ids), deepspeed(ids)
    assert a.router_stats.dropped_fraction.min().item() > 0
    torch.testing.assert_close(b.router_stats.dropped_fraction, a.router_stats.dropped_fraction)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-6)


def test_deepspeed_block_is_idempotent_under_repeated_setup():
    model = AdaptiveForCausalLM(tiny_config("moe", moe_implementation="deepspeed"))
    model.setup_expert_parallel()
    model.setup_expert_parallel()
    for block in (m for m in model.modules() if type(m).__name__ == "DeepSpeedMoE"):
        block.set_deepspeed_parallelism()  # what deepspeed.initialize calls; must not assert
        assert block.expert_parallel_ready


def test_deepspeed_checkpoint_loads_as_native_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from safetensors import safe_open

    deepspeed = AdaptiveForCausalLM(tiny_config("hybrid", moe_implementation="deepspeed")).eval()
    deepspeed.setup_expert_parallel()  # process groups before the first forward
    deepspeed.save_pretrained(tmp_path)
    assert deepspeed.config.moe_implementation == "deepspeed"  # saving does not change the running model
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:  # DeepSpeed's names stay inside its block
        assert f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape() == [8, 64, 32]
        assert not any("deepspeed" in k for k in f.keys())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.moe_implementation == "native"  # the portable default for inference
    assert not any(type(m).__name__ == "DeepSpeedMoE" for m in loaded.modules())
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(loaded(ids).logits, deepspeed(ids).logits, rtol=1e-5, atol=1e-6)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, moe_implementation="deepspeed").eval()
    assert any(type(m).__name__ == "DeepSpeedMoE" for m in again.modules())
    torch.testing.assert_close(again(ids).logits, deepspeed(ids).logits, rtol=1e-5, atol=1e-6)


def test_unused_tokens_take_no_expert_and_stay_out_of_the_statistics():
    logits = random_logits(30, 8, 10)
    used = torch.rand(30, generator=torch.Generator().manual_seed(11)) > 0.3
    full = route(logits, 2, None, 0, used=used)
    subset = route(logits[used], 2, None, 0)
    assert (full.experts[:, ~used] == -1).all()
    assert torch.equal(full.experts[:, used], subset.experts)
    torch.testing.assert_close(full.weights[:, used], subset.weights)
    assert torch.equal(full.stats.expert_counts, subset.stats.expert_counts)
    torch.testing.assert_close(full.stats.l_aux, subset.stats.l_aux)
    torch.testing.assert_close(full.stats.z_loss, subset.stats.z_loss)
    assert full.stats.dropped_fraction.item() == 0.0


@pytest.mark.parametrize("arch", ["moe", "hybrid"])
def test_padding_does_not_reach_real_tokens_through_expert_capacity(arch):
    model = tiny_model(arch, pad_token_id=0, capacity_factor=0.5).train()
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(12))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    other = ids.clone()
    other[1, :6] = torch.randint(1, 128, (6,), generator=torch.Generator().manual_seed(13))  # different padding
    a = model(ids, attention_mask=mask)
    b = model(other, attention_mask=mask)
    assert a.router_stats.dropped_fraction.max() > 0
    real = mask.bool()
    torch.testing.assert_close(a.logits[real], b.logits[real])


def test_rsample_noise_applies_in_training_only():
    model = tiny_model("moe", num_experts_per_tok=1, noisy_gate_policy="RSample", drop_tokens=False)
    gate = model.model.layers[0].mlp.gate
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(14))
    gate.train()
    noisy = [gate(x).experts for _ in range(2)]
    assert not torch.equal(noisy[0], noisy[1])
    gate.eval()
    assert torch.equal(gate(x).experts, gate(x).experts)
    assert torch.equal(gate(x).experts[0], (x @ gate.weight.t()).argmax(dim=-1))


@pytest.mark.parametrize("lean", [False, True], ids=["plain", "lean"])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_mm_and_the_per_expert_loop_are_bitwise_equal(monkeypatch, bias, lean):
    from adaptive.models import moe

    experts = moe.GroupedExperts(8, 32, 48, bias=bias, lean=lean)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(generator=torch.Generator().manual_seed(p.numel()))
    x = torch.randn(70, 32, generator=torch.Generator().manual_seed(1))
    counts = [9, 0, 20, 3, 11, 0, 17, 10]  # empty groups included
    grad = torch.randn(70, 32, generator=torch.Generator().manual_seed(2))
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(moe, "GROUPED_MM_ENABLED", enabled)
        assert moe._use_grouped_mm(x, 32, 48) == enabled
        experts.zero_grad()
        out = experts.grouped(x, counts)
        (out * grad).sum().backward()
        results.append([out.detach()] + [p.grad.clone() for p in experts.parameters()])
    for a, b in zip(*results):  # both add the biases after the matmuls
        assert torch.equal(a, b)
    # and each group is its own expert's SwiGLU
    start = sum(counts[:2])
    w1, w2 = experts.gate_up_proj[2], experts.down_proj[2]
    h = x[start:start + 20] @ w1.t() + (experts.gate_up_proj_bias[2] if bias else 0)
    gate, up = h.chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up) @ w2.t() + (experts.down_proj_bias[2] if bias else 0)
    torch.testing.assert_close(results[0][0][start:start + 20], expected, rtol=1e-5, atol=1e-5)


def test_a_deepspeed_named_checkpoint_loads_into_the_native_block(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    model = tiny_model("hybrid").eval()
    model.save_pretrained(tmp_path)
    native = load_file(tmp_path / "model.safetensors")
    old = {k: v.contiguous() for k, v in to_deepspeed_layout(native).items()}  # the layout before 3D experts
    assert any("deepspeed_experts.7.up_proj" in k for k in old)
    save_file(old, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(9))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
