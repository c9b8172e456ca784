"""The real model's parameters equal the planner's analytic count, total and active, for every preset and arch.

Big presets are built on the meta device (no memory). The DeepSpeed MoE block cannot differ: its state dict
converts to the native block's names and shapes, checked at tiny size.
"""

from __future__ import annotations

import pytest
import torch
from _model_helpers import tiny_config

from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM
from adaptive.models.moe import from_deepspeed_layout, to_deepspeed_layout
from adaptive.plan.architecture.params import count_params
from adaptive.plan.architecture.presets import ARCHS, PRESETS


def active_params(model: AdaptiveForCausalLM) -> int:
    """Non-expert parameters plus k experts per MoE layer, read off the module tree (3D experts [E, ...])."""
    k, experts = model.config.num_experts_per_tok, model.config.num_local_experts
    total = 0
    for name, p in model.named_parameters():
        if ".experts." not in name:
            total += p.numel()
        else:
            total += k * p.numel() // experts
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


def test_deepspeed_block_converts_to_the_native_names_and_shapes():
    native = AdaptiveForCausalLM(tiny_config("hybrid"))
    deepspeed = AdaptiveForCausalLM(tiny_config("hybrid", moe_implementation="deepspeed"))
    shapes = {k: v.shape for k, v in native.state_dict().items()}
    assert shapes == {k: v.shape for k, v in from_deepspeed_layout(deepspeed.state_dict()).items()}
    assert shapes["model.layers.1.mlp.experts.gate_up_proj"] == (8, 64, 32)  # Mixtral's [E, 2I, H]
    assert any(".mlp.gate.e_score_correction_bias" in k for k in shapes)
    assert set(to_deepspeed_layout(native.state_dict())) == set(deepspeed.state_dict())


def test_deepspeed_block_builds_on_meta_with_the_planned_count():
    config = AdaptiveConfig.from_preset("b7", arch="hybrid", moe_implementation="deepspeed")
    with torch.device("meta"):
        model = AdaptiveForCausalLM(config)
    assert any(type(m).__name__ == "DeepSpeedMoE" for m in model.modules())
    assert sum(p.numel() for p in model.parameters()) == count_params(config.to_spec()).total
