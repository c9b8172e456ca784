"""Presets: sizes near their names, valid head shapes, and counts equal to an independent hand count."""

import pytest

from adaptive.plan import ARCHS, PRESETS, count_params, preset_spec


def hand_count(name: str, arch: str) -> tuple[int, int]:
    """Count every weight matrix of the Llama-style block by name, independently of params.py."""
    s = preset_spec(name, arch)
    h, hd = s.hidden_size, s.head_dim
    matrices = {"embed_tokens": s.vocab_size * h, "lm_head": s.vocab_size * h, "norm": h}
    active = dict(matrices)
    for i, t in enumerate(s.layer_types):
        layer = {
            f"{i}.q_proj": h * s.num_attention_heads * hd,
            f"{i}.k_proj": h * s.num_key_value_heads * hd,
            f"{i}.v_proj": h * s.num_key_value_heads * hd,
            f"{i}.o_proj": s.num_attention_heads * hd * h,
            f"{i}.input_layernorm": h,
            f"{i}.post_attention_layernorm": h,
        }
        if t in ("mod", "hybrid"):
            layer[f"{i}.mod_router"] = h
        layer_active = dict(layer)
        if t in ("moe", "hybrid"):
            layer[f"{i}.gate"] = layer_active[f"{i}.gate"] = h * s.num_local_experts
            for e in range(s.num_local_experts):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    layer[f"{i}.experts.{e}.{proj}"] = h * s.moe_intermediate_size
                    if e < s.num_experts_per_tok:
                        layer_active[f"{i}.experts.{e}.{proj}"] = h * s.moe_intermediate_size
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                layer[f"{i}.mlp.{proj}"] = layer_active[f"{i}.mlp.{proj}"] = h * s.intermediate_size
        matrices.update(layer)
        active.update(layer_active)
    return sum(matrices.values()), sum(active.values())


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("arch", ARCHS)
def test_analytic_counts_equal_hand_count(name, arch):
    c = count_params(preset_spec(name, arch))
    total, active = hand_count(name, arch)
    assert (c.total, c.active) == (total, active)


@pytest.mark.parametrize("name", list(PRESETS))
def test_dense_preset_is_within_ten_percent_of_its_nominal_size(name):
    s = PRESETS[name]
    total = count_params(preset_spec(name, "dense")).total
    assert abs(total / s.nominal_params - 1) <= 0.10, (name, total)


@pytest.mark.parametrize("name", list(PRESETS))
def test_head_dims_are_even_and_divide_evenly(name):
    s = preset_spec(name)
    assert s.hidden_size % s.num_attention_heads == 0
    assert s.head_dim % 2 == 0  # RoPE rotates pairs
    assert s.num_attention_heads % s.num_key_value_heads == 0


def test_arch_patterns_route_every_other_block_and_use_top2_of_8():
    moe, mod, hybrid = (preset_spec("b1", a) for a in ("moe", "mod", "hybrid"))
    assert set(moe.layer_types) == {"moe"} and (moe.num_local_experts, moe.num_experts_per_tok) == (8, 2)
    assert mod.layer_types[0] == "dense" and mod.layer_types[1] == "mod"
    assert mod.num_mod_layers == mod.num_hidden_layers // 2
    assert hybrid.layer_types[:2] == ("moe", "hybrid")
    assert 0.5 <= mod.mod_capacity <= 0.6


def test_moe_has_more_total_than_active_and_mod_routes_exactly_k():
    c = count_params(preset_spec("b7", "moe"))
    assert c.total > 3 * c.active > 0
    mod = preset_spec("b7", "mod")
    assert mod.mod_tokens(2048) == 1024 and mod.mod_tokens(7) == 4
