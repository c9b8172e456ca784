"""AdaptiveConfig: built from the planner's presets, validated with AdaptiveError, saved like any HF config."""

from __future__ import annotations

import pytest

from adaptive.errors import AdaptiveError
from adaptive.models import AdaptiveConfig
from adaptive.plan.architecture.presets import ARCHS, PRESETS, preset_spec


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("arch", ARCHS)
def test_from_preset_matches_planner_spec(name, arch):
    config = AdaptiveConfig.from_preset(name, arch=arch)
    spec = preset_spec(name, arch)
    assert config.to_spec() == spec.__class__(**{**spec.__dict__, "nominal_params": None})
    assert config.block_types == list(spec.layer_types)
    assert (config.preset, config.arch) == (name, arch)


def test_arch_knobs_go_through_the_layer_pattern():
    config = AdaptiveConfig.from_preset("debug", arch="hybrid", num_local_experts=4, num_experts_per_tok=1,
                                        mod_capacity=0.125, moe_layer_freq=2, mod_layer_freq=2)
    assert config.block_types == ["dense", "hybrid", "dense", "hybrid", "dense"]
    assert (config.num_local_experts, config.num_experts_per_tok, config.mod_capacity) == (4, 1, 0.125)


def test_layer_types_keeps_transformers_meaning():
    # DynamicCache(config=...) reads layer_types; ours must say "full attention" everywhere.
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    config = AdaptiveConfig.from_preset("debug", arch="hybrid")
    assert config.layer_types == ["full_attention"] * config.num_hidden_layers
    cache = DynamicCache(config=config)
    assert len(cache.layers) == config.num_hidden_layers
    assert all(type(layer) is DynamicLayer for layer in cache.layers)


def test_save_and_reload_round_trips(tmp_path):
    config = AdaptiveConfig.from_preset("b1", arch="hybrid", router_z_loss_coef=1e-3, eval_capacity_factor=2.0)
    config.save_pretrained(tmp_path)
    again = AdaptiveConfig.from_pretrained(tmp_path)
    assert again.to_spec() == config.to_spec()
    assert (again.router_z_loss_coef, again.eval_capacity_factor) == (1e-3, 2.0)
    assert again.rope_parameters["rope_theta"] == 10000.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(arch="moe", ep_size=3, moe_implementation="deepspeed"),
         r"num_local_experts \(8\) must be divisible by ep_size \(3\)"),
        (dict(arch="moe", ep_size=2), "needs moe_implementation='deepspeed'"),
        (dict(arch="moe", num_experts_per_tok=3), "top_k"),
        (dict(arch="moe", moe_implementation="deepseed"), "did you mean 'deepspeed'"),
        (dict(arch="mod", mod_routing="topK"), "did you mean 'topk'"),
        (dict(arch="mod", mod_capacity=0.0), "mod_capacity"),
        (dict(arch="dense", num_key_value_heads=3), "divisible by num_key_value_heads"),
        (dict(arch="dense", ep_sise=2), "did you mean ep_size"),
        (dict(arch="dense", num_hidden_layers=3), "block_types"),
    ],
)
def test_bad_settings_raise_adaptive_error(overrides, message):
    arch = overrides.pop("arch")
    with pytest.raises(AdaptiveError, match=message):
        AdaptiveConfig.from_preset("debug", arch=arch, **overrides)


def test_unknown_block_type_is_rejected():
    with pytest.raises(AdaptiveError, match="block_types entry"):
        AdaptiveConfig(block_types=["dense", "moe", "mod", "hybrid", "sparse"])


def test_shared_expert_specs_are_rejected():
    spec = preset_spec("debug", "moe")
    spec = spec.__class__(**{**spec.__dict__, "shared_expert_intermediate_size": 64})
    with pytest.raises(AdaptiveError, match="shared_expert_intermediate_size"):
        AdaptiveConfig.from_spec(spec)
