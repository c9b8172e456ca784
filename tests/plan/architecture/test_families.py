"""transformers' decoder families (families.py) against the installed transformers' own classes on the meta device:
parameter counts, the nn.Linear modules LoRA targets and bitsandbytes quantizes, and the config classes' defaults."""

import json

import pytest
import torch

from adaptive.errors import AdaptiveError
from adaptive.plan import count_params
from adaptive.plan.architecture.families import FAMILIES, HF_TYPES, linear_modules, resolve_targets
from adaptive.plan.architecture.hf_config import spec_from_hf_config

# A small config of every family, with the fields a downloaded config.json carries (odd sizes on purpose)
CONFIGS = {
    "llama": dict(model_type="llama", vocab_size=1003, hidden_size=96, intermediate_size=200, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    "mistral": dict(model_type="mistral", vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=24),
    "qwen2": dict(model_type="qwen2", vocab_size=1500, hidden_size=80, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=5, num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", vocab_size=1500, hidden_size=64, intermediate_size=192, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    "gemma2": dict(model_type="gemma2", vocab_size=2048, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0),
    "gemma3_text": dict(model_type="gemma3_text", vocab_size=2048, hidden_size=64, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                        pad_token_id=0),
    "phi3": dict(model_type="phi3", vocab_size=1100, hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=3, pad_token_id=0, tie_word_embeddings=False),
    "mixtral": dict(model_type="mixtral", vocab_size=1000, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=1000, hidden_size=64, intermediate_size=160,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
                      num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[2]),
    "qwen2_moe": dict(model_type="qwen2_moe", vocab_size=1000, hidden_size=64, intermediate_size=160,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=96),
}


def test_every_family_has_a_config_here():
    assert set(CONFIGS) == set(HF_TYPES)


def _build(tmp_path, cfg):
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    return model, spec_from_hf_config(str(tmp_path / "config.json"))


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_counts_and_linear_modules_equal_transformers_class(tmp_path, model_type):
    model, spec = _build(tmp_path, CONFIGS[model_type])
    assert type(model).__name__ == FAMILIES[model_type].class_name
    assert count_params(spec).total == sum(p.numel() for p in model.parameters())
    # every nn.Linear of the built model, by its name inside a layer (or at the top), with its shape and count
    built: dict[tuple, int] = {}
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear:
            key = name.split(".", 3)[-1] if ".layers." in name else name
            shape = (module.in_features, module.out_features, module.bias is not None)
            built[(key, *shape)] = built.get((key, *shape), 0) + 1
    planned = {(m.name, m.in_features, m.out_features, m.bias): m.count for m in linear_modules(spec)}
    assert planned == built


def test_config_class_defaults_are_the_families(tmp_path):
    """head_dim and tie_word_embeddings when config.json leaves them out: the config classes' own defaults."""
    from transformers import AutoConfig

    for model_type, family in FAMILIES.items():
        if model_type == "adaptive":
            continue
        cfg = AutoConfig.for_model(model_type)
        assert cfg.tie_word_embeddings == family.default_tie, model_type
        if family.default_head_dim is not None:
            assert cfg.head_dim == family.default_head_dim, model_type


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2"])
def test_omitted_head_dim_and_tie_count_as_transformers_builds_them(tmp_path, model_type):
    cfg = {k: v for k, v in CONFIGS[model_type].items() if k not in ("head_dim", "tie_word_embeddings")}
    model, spec = _build(tmp_path, cfg)
    assert count_params(spec).total == sum(p.numel() for p in model.parameters())


def test_lora_targets_resolve_as_peft_matches_them(tmp_path):
    _, spec = _build(tmp_path, CONFIGS["phi3"])
    assert [m.leaf for m in resolve_targets(spec, "all-linear")] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert [m.leaf for m in resolve_targets(spec, "attention")] == ["qkv_proj", "o_proj"]
    assert [m.leaf for m in resolve_targets(spec, "o_proj, down_proj")] == ["o_proj", "down_proj"]
    with pytest.raises(AdaptiveError, match=r"'q_proj' matches no linear layer .*did you mean qkv_proj"):
        resolve_targets(spec, "q_proj")


def test_moe_experts_are_lora_targets_by_transformers_4_names(tmp_path):
    """PEFT 0.21 maps Mixtral's w1/w3/w2 and router `gate` onto transformers 5's 3D experts and router weight."""
    _, spec = _build(tmp_path, CONFIGS["mixtral"])
    assert {m.role for m in resolve_targets(spec, "all-linear")} == {"attention", "router", "experts"}
    assert [m.name for m in resolve_targets(spec, "w2")] == ["mlp.experts.down_proj"]
    with pytest.raises(AdaptiveError, match="3D parameters.*w1, w3, w2"):
        resolve_targets(spec, "experts")
    with pytest.raises(AdaptiveError, match="w1 needs w3 too"):
        resolve_targets(spec, "w1")
    _, spec = _build(tmp_path, CONFIGS["qwen2_moe"])  # no PEFT pattern: its nn.Linear modules only
    assert {m.role for m in resolve_targets(spec, "all-linear")} == {"attention", "shared_expert"}
