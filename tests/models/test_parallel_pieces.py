"""What sequence and tensor parallelism ask of the model, on one process: labels shifted before the sequence is
cut give the same loss, the shards' losses over the group's label count sum to the whole sequence's, the MLP
runs when AutoTP swaps its down projection for a one-input layer, and the tp_plan names real modules."""

from __future__ import annotations

import re

import torch
from torch import nn

from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM
from adaptive.models.lean import IGNORE_INDEX, lean_causal_lm_loss, shift_labels


def _model(seed: int = 0) -> AdaptiveForCausalLM:
    torch.manual_seed(seed)
    return AdaptiveForCausalLM(AdaptiveConfig())


def test_shift_labels_give_the_loss_labels_give():
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    model.train()  # the lean chunked loss
    lean = model(input_ids=ids, labels=ids).loss
    assert torch.equal(model(input_ids=ids, shift_labels=shift_labels(ids).contiguous()).loss, lean)
    model.eval()  # logits and transformers' loss function
    plain = model(input_ids=ids, labels=ids).loss
    assert torch.allclose(model(input_ids=ids, shift_labels=shift_labels(ids).contiguous()).loss, plain, atol=1e-6)
    assert torch.allclose(plain, lean, atol=1e-5)


def test_the_shards_losses_over_the_group_count_sum_to_the_sequence_loss():
    """What each Ulysses rank backpropagates: its shard's summed token loss / the group's unmasked labels."""
    model = _model()
    hidden = torch.randn(2, 32, model.config.hidden_size)
    labels = torch.randint(0, model.config.vocab_size, (2, 32))
    labels[0, 5] = IGNORE_INDEX
    whole = lean_causal_lm_loss(model.lm_head, hidden, labels)
    shifted = shift_labels(labels)  # before the cut: a shard's last token predicts the next shard's first
    count = (shifted != IGNORE_INDEX).sum()
    shards = [lean_causal_lm_loss(model.lm_head, hidden[:, i:i + 16], None, count, shifted_labels=shifted[:, i:i + 16])
              for i in (0, 16)]
    assert torch.allclose(sum(shards), whole, atol=1e-6)


def test_the_mlp_runs_when_autotp_swaps_its_down_projection():
    """AutoTP's row-parallel layer takes one input; the MLP then takes the plain path (the same values)."""
    model = _model()
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 5, model.config.hidden_size)
    lean = mlp(x)
    swapped = nn.Linear(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False)
    swapped.weight = mlp.down_proj.weight
    mlp.down_proj = swapped
    assert torch.allclose(mlp(x), lean, atol=1e-6)


def test_the_tp_plan_names_the_dense_and_attention_projections():
    model = _model()
    names = [name for name, _ in model.model.named_modules()]
    assert len(model.config.base_model_tp_plan) == 7
    for pattern in model.config.base_model_tp_plan:
        regex = re.compile(pattern.replace(".", r"\.").replace("*", r"\d+") + "$")
        assert sum(bool(regex.match(n)) for n in names) == model.config.num_hidden_layers, pattern
    assert model.tp_plan["lm_head"] == "colwise_gather_output"  # Llama's, with the embedding transformers adds
    moe = AdaptiveConfig.from_preset("debug", arch="moe")
    assert set(moe.base_model_tp_plan) == {p for p in model.config.base_model_tp_plan if "self_attn" in p} or \
        any(t == "dense" for t in moe.block_types)


def test_the_tp_plan_of_deepspeed_moe_names_every_experts_projections():
    """Expert tensor parallelism: AutoTP shards DeepSpeed-MoE's experts like the dense MLP (column-parallel
    gate/up, row-parallel down); the native block's 3D experts are not nn.Linear, so its plan leaves them out."""
    native = AdaptiveConfig.from_preset("debug", arch="moe")
    assert not any("experts" in p for p in native.base_model_tp_plan)
    config = AdaptiveConfig.from_preset("debug", arch="moe", moe_implementation="deepspeed")
    model = AdaptiveForCausalLM(config)
    names = [name for name, _ in model.model.named_modules()]
    experts = {p: s for p, s in config.base_model_tp_plan.items() if "experts" in p}
    assert sorted(experts.values()) == ["colwise", "colwise", "rowwise"]
    for pattern in experts:
        regex = re.compile(pattern.replace(".", r"\.").replace("*", r"\d+") + "$")
        assert sum(bool(regex.match(n)) for n in names) == len(config.moe_layers) * config.num_local_experts, pattern
