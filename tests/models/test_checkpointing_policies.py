"""Selective activation checkpointing (adaptive/models/checkpointing.py): every policy gives the loss and
gradients of no checkpointing, keeps fewer bytes than no checkpointing, and more than full."""

from __future__ import annotations

import pytest
import torch
from _model_helpers import tiny_model

from adaptive.errors import AdaptiveError
from adaptive.models.checkpointing import apply_checkpointing, checkpointing_policy

POLICIES = ("off", "full", "every:2", "mlp")


def loss_grads_saved(model, ids):
    from adaptive.fidelity.measure import count_saved_bytes

    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # jitter noise must replay identically in the recompute
    saved: dict = {}
    with count_saved_bytes(saved):
        loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, saved["bytes"]


def test_every_policy_gives_the_same_loss_and_gradients(arch):
    model = tiny_model(arch, mod_predictor_hidden_size=8, noisy_gate_policy="Jitter").train()
    ids = torch.randint(0, 128, (3, 32), generator=torch.Generator().manual_seed(0))
    results = {}
    for policy in POLICIES:
        apply_checkpointing(model, policy)
        assert checkpointing_policy(model) == policy
        results[policy] = loss_grads_saved(model, ids)
    loss, grads, saved = results["off"]
    for policy in POLICIES[1:]:
        other_loss, other_grads, other_saved = results[policy]
        assert torch.equal(loss, other_loss), policy
        assert grads.keys() == other_grads.keys()
        for name in grads:
            torch.testing.assert_close(other_grads[name], grads[name], rtol=1e-5, atol=1e-7, msg=f"{policy} {name}")
        assert other_saved < saved, policy
        if policy != "full":
            assert other_saved > results["full"][2], policy


def test_every_n_checkpoints_blocks_0_n_2n():
    model = tiny_model("dense")
    apply_checkpointing(model, "every:2")
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False, True, False, True]
    apply_checkpointing(model, "mlp")  # replaces the previous policy
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)
    assert all(layer.checkpoint_mlp for layer in model.model.layers)


@pytest.mark.parametrize("bad", ["some", "every:0", "every:x"])
def test_unknown_policy_is_refused_by_name(bad):
    with pytest.raises(AdaptiveError, match="off, full, mlp or every:N"):
        apply_checkpointing(tiny_model("dense"), bad)
