"""The real model's parameters equal the planner's analytic count, total and active, for every preset and arch.

Big presets are built on the meta device (no memory). The DeepSpeed MoE block cannot differ: it has the
native block's names and shapes, checked at tiny size.
"""

from __future__ import annotations

import pytest
import torch
from _model_helpers import tiny_config

from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM
from adaptive.plan.params import count_params
from adaptive.plan.presets import ARCHS, PRESETS


def active_params(model: AdaptiveForCausalLM) -> int:
    """Non-expert parameters plus k experts per MoE layer, read off the module tree."""
    k = model.config.num_experts_per_tok
    total = 0
    for name, p in model.named_parameters():
        if ".deepspeed_experts." not in name:
            total += p.numel()
        elif ".deepspeed_experts.0." in name:
            total += k * p.numel()
    return total


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("arch", ARCHS)
def test_param_count_matches_planner(name, arch):
    config = AdaptiveConfig.from_preset(name, arch=arch)
    with torch.device("meta"):
        model = AdaptiveForCausalLM(config)
    counts = count_params(config.to_spec())
    assert sum(p.numel() for p in model.parameters()) == counts.total
    assert active_params(model) == counts.active


@pytest.mark.parametrize("overrides", [
    dict(tie_word_embeddings=True), dict(qkv_bias=True, o_bias=True), dict(mlp_bias=True),
    dict(mod_predictor_hidden_size=16),
])
def test_param_count_matches_planner_for_variants(overrides):
    config = tiny_config("hybrid", **overrides)
    model = AdaptiveForCausalLM(config)
    counts = count_params(config.to_spec())
    assert sum(p.numel() for p in model.parameters()) == counts.total
    assert active_params(model) == counts.active


def test_deepspeed_block_has_the_native_names_and_shapes():
    native = AdaptiveForCausalLM(tiny_config("hybrid"))
    deepspeed = AdaptiveForCausalLM(tiny_config("hybrid", moe_implementation="deepspeed"))
    shapes = {k: v.shape for k, v in native.state_dict().items()}
    assert shapes == {k: v.shape for k, v in deepspeed.state_dict().items()}
    assert any(".deepspeed_moe.gate.e_score_correction_bias" in k for k in shapes)
