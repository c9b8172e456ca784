"""Mixture-of-Depths: exactly k tokens, original positions, causal attention among the routed tokens, the router
weight on the delta only, causal routing at inference, and the routed layer's KV cache."""

from __future__ import annotations

import math

import pytest
import torch
from _model_helpers import tiny_model

from adaptive.models.mod import plan_routing


def one_layer_twins(**overrides):
    """A 1-layer MoD model and a dense model with the same attention/MLP weights."""
    routed = tiny_model("mod", num_hidden_layers=1, block_types=["mod"], **overrides)
    dense = tiny_model("dense", num_hidden_layers=1, block_types=["dense"])
    missing, unexpected = dense.load_state_dict(routed.state_dict(), strict=False)
    assert not missing and all(".mod." in k for k in unexpected)
    return routed, dense


def layer_input_and_output(model, ids, padding_mask=None):
    """The embedded input of the single layer and that layer's output."""
    x = model.model.embed_tokens(ids)
    positions = torch.arange(ids.shape[1])[None]
    out, _ = model.model.layers[0](x, position_ids=positions, position_embeddings=model.model.rotary_emb(x, positions),
                                   padding_mask=padding_mask)
    return x, out


def dense_on_subsequence(dense, x_row, positions):
    """The dense twin run on only `positions` of one sequence, with those RoPE positions, causally."""
    sub = x_row[positions][None]
    pos = positions[None]
    out, _ = dense.model.layers[0](sub, position_ids=pos, position_embeddings=dense.model.rotary_emb(sub, pos))
    return out[0]


def test_topk_routes_exactly_k_tokens_per_sequence():
    logits = torch.randn(3, 17, generator=torch.Generator().manual_seed(0))
    plan = plan_routing(logits, None, capacity=0.3, mode="topk", weight_fn="sigmoid")
    k = math.ceil(0.3 * 17)
    assert plan.index.shape == (3, k)
    assert plan.valid is None
    for row in range(3):
        assert plan.index[row].tolist() == sorted(logits[row].topk(k).indices.tolist())
    assert plan.stats.skip_rate.item() == pytest.approx(1 - k / 17)


@pytest.mark.parametrize("capacity", [0.125, 0.5])
def test_routed_layer_changes_exactly_k_tokens_and_matches_dense_on_them(capacity):
    routed, dense = one_layer_twins(mod_capacity=capacity)
    routed.train()
    ids = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(1))
    x, out = layer_input_and_output(routed, ids)
    logits = routed.model.layers[0].mod.router(x).squeeze(-1)
    k = math.ceil(capacity * 24)
    for row in range(3):
        changed = (out[row] != x[row]).any(dim=-1).nonzero().flatten()
        chosen = logits[row].topk(k).indices.sort().values
        assert changed.tolist() == chosen.tolist()
        # the routed tokens: dense block on the subsequence at their original positions, delta scaled by sigmoid(r)
        delta = dense_on_subsequence(dense, x[row], chosen) - x[row, chosen]
        expected = x[row, chosen] + torch.sigmoid(logits[row, chosen])[:, None] * delta
        torch.testing.assert_close(out[row, chosen], expected, rtol=1e-5, atol=1e-6)


def test_wrong_positions_would_fail_the_check_above():
    # renumbering the routed tokens 0..k-1 moves the result far beyond the 1e-6 tolerance used above
    routed, dense = one_layer_twins(mod_capacity=0.25)
    routed.train()
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(2))
    x, _ = layer_input_and_output(routed, ids)
    chosen = routed.model.layers[0].mod.router(x).squeeze(-1)[0].topk(6).indices.sort().values
    assert chosen.tolist() != list(range(6))
    sub = x[0, chosen][None]
    renumbered = dense.model.layers[0](sub, position_ids=torch.arange(6)[None],
                                       position_embeddings=dense.model.rotary_emb(sub, torch.arange(6)[None]))[0]
    right = dense_on_subsequence(dense, x[0], chosen)
    assert (renumbered[0] - right).abs().max() > 1e-5


def test_capacity_one_with_unit_weight_equals_the_dense_block():
    routed, dense = one_layer_twins(mod_capacity=1.0, mod_router_weight="none")
    routed.train()
    dense.train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    # not bitwise: a routed block adds its delta (attention + MLP) at once, a dense block adds attention,
    # then MLP (Llama's order, which exported models reproduce bitwise)
    torch.testing.assert_close(routed(ids).logits, dense(ids).logits, rtol=0, atol=1e-6)


def test_causal_routing_with_different_counts_per_sequence():
    routed, dense = one_layer_twins(mod_capacity=0.5, pad_token_id=0)
    routed.eval()
    ids = torch.randint(1, 128, (3, 20), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[2, :5] = 0
    x, out = layer_input_and_output(routed, ids, padding_mask=mask.bool())
    chosen = (routed.model.layers[0].mod.router(x).squeeze(-1) > 0) & mask.bool()
    counts = chosen.sum(dim=1)
    assert len(set(counts.tolist())) > 1  # rows route different numbers of tokens
    for row in range(3):
        positions = chosen[row].nonzero().flatten()
        changed = (out[row] != x[row]).any(dim=-1).nonzero().flatten()
        assert changed.tolist() == positions.tolist()
        delta = dense_on_subsequence(dense, x[row], positions) - x[row, positions]
        logit = routed.model.layers[0].mod.router(x[row, positions]).squeeze(-1)
        torch.testing.assert_close(out[row, positions], x[row, positions] + torch.sigmoid(logit)[:, None] * delta,
                                   rtol=1e-5, atol=1e-6)


def test_eval_forward_is_causal(arch):
    model = tiny_model(arch).eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    changed = ids.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % 128
    a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize(("weight", "gets_grad"), [("sigmoid", True), ("logit", True), ("none", False)])
def test_router_learns_from_the_lm_loss_through_its_weight(weight, gets_grad):
    model = tiny_model("mod", mod_router_weight=weight, mod_aux_loss_coef=0.0).train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(6))
    model(ids, labels=ids).loss.backward()
    grad = model.model.layers[1].mod.router.weight.grad
    assert (grad is not None and grad.abs().sum() > 0) == gets_grad


def test_bce_targets_the_topk_mask_and_the_predictor_reads_a_detached_input():
    model = tiny_model("mod", mod_predictor_hidden_size=8, mod_capacity=0.25).train()
    router = model.model.layers[1].mod
    x = torch.randn(2, 16, 32, requires_grad=True)
    logits, predicted = router(x)
    plan = plan_routing(logits, predicted, 0.25, "topk", "sigmoid")
    target = torch.zeros(2, 16).scatter_(1, logits.topk(4, dim=-1).indices, 1.0)
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    torch.testing.assert_close(plan.stats.bce_loss, bce(logits, target) + bce(predicted, target))
    agreement = ((predicted > 0) == target.bool()).float().mean()
    torch.testing.assert_close(plan.stats.router_agreement, agreement)
    predicted.sum().backward()
    assert x.grad is None  # stop-gradient input: the predictor cannot disturb the residual stream


def test_predictor_drives_causal_routing_when_present():
    model = tiny_model("mod", mod_predictor_hidden_size=8).eval()
    router = model.model.layers[1].mod
    with torch.no_grad():
        router.predictor[2].weight.zero_()  # predictor logit 0 -> nothing routed
    out = model(torch.randint(0, 128, (2, 16)))
    assert torch.equal(out.router_stats.mod_skip_rate[0], torch.tensor(1.0))


def test_cache_crop_forgets_routed_keys_past_the_cut():
    model = tiny_model("mod").eval()
    ids = torch.randint(0, 128, (2, 14), generator=torch.Generator().manual_seed(7))
    full = model(ids, use_cache=True).cache
    short = model(ids[:, :9], use_cache=True).cache
    full.crop(-5)
    for i in model.config.mod_layers:
        a, b = full.layers[i], short.layers[i]
        assert a.get_seq_length() == b.get_seq_length() == 9
        for row in range(2):
            assert a.slots[row][a.key_valid[row]].tolist() == b.slots[row][b.key_valid[row]].tolist()
    nxt = ids[:, 9:10]
    torch.testing.assert_close(model(nxt, cache=full).logits, model(nxt, cache=short).logits)
