"""HF config.json files: our analytic counts equal transformers' own models on the meta device."""

import json

import pytest
import torch

from adaptive.errors import AdaptiveError
from adaptive.plan import count_params
from adaptive.plan.architecture.hf_config import spec_from_hf_config

CONFIGS = {
    "llama": dict(model_type="llama", vocab_size=32003, hidden_size=384, intermediate_size=1000,
                  num_hidden_layers=3, num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=False),
    "llama_tied_bias": dict(model_type="llama", vocab_size=1001, hidden_size=256, intermediate_size=704,
                            num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=8,
                            tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "mistral": dict(model_type="mistral", vocab_size=32768, hidden_size=512, intermediate_size=1792,
                    num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=2, head_dim=48),
    "qwen2": dict(model_type="qwen2", vocab_size=15111, hidden_size=320, intermediate_size=960,
                  num_hidden_layers=7, num_attention_heads=10, num_key_value_heads=2),
    "mixtral": dict(model_type="mixtral", vocab_size=32000, hidden_size=256, intermediate_size=448,
                    num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, num_local_experts=6,
                    num_experts_per_tok=2),
    "qwen2_moe": dict(model_type="qwen2_moe", vocab_size=5003, hidden_size=256, intermediate_size=640,
                      num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=4, num_experts=6,
                      num_experts_per_tok=3, moe_intermediate_size=96, shared_expert_intermediate_size=384,
                      decoder_sparse_step=2, mlp_only_layers=[3]),
}


def write(tmp_path, cfg) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_counts_equal_transformers_models_on_meta(tmp_path, name):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = write(tmp_path, CONFIGS[name])
    hf_config = AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    real = sum(p.numel() for p in model.parameters())
    assert count_params(spec_from_hf_config(path)).total == real


def test_mixtral_active_params_count_top_k_experts(tmp_path):
    cfg = CONFIGS["mixtral"]
    spec = spec_from_hf_config(write(tmp_path, cfg))
    c = count_params(spec)
    expert = 3 * cfg["hidden_size"] * cfg["intermediate_size"]
    assert c.total - c.active == cfg["num_hidden_layers"] * (cfg["num_local_experts"] - 2) * expert


def test_malformed_json_names_the_file_and_position(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": 64,')
    with pytest.raises(AdaptiveError, match=r"malformed config.json .*line 1"):
        spec_from_hf_config(str(path))


def test_unknown_model_type_suggests_a_close_one(tmp_path):
    with pytest.raises(AdaptiveError, match="did you mean mixtral"):
        spec_from_hf_config(write(tmp_path, dict(CONFIGS["mixtral"], model_type="mixtrall")))


def test_missing_and_non_positive_fields_are_named(tmp_path):
    cfg = dict(CONFIGS["llama"])
    del cfg["hidden_size"]
    with pytest.raises(AdaptiveError, match="hidden_size"):
        spec_from_hf_config(write(tmp_path, cfg))
    with pytest.raises(AdaptiveError, match="num_hidden_layers must be positive"):
        spec_from_hf_config(write(tmp_path, dict(CONFIGS["llama"], num_hidden_layers=0)))


@pytest.mark.parametrize("arch", ["dense", "moe", "mod", "hybrid"])
def test_our_own_exported_config_plans_with_the_saved_models_counts(tmp_path, arch):
    from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM

    model = AdaptiveForCausalLM(AdaptiveConfig.from_preset("debug", arch=arch))
    model.save_pretrained(tmp_path)
    spec = spec_from_hf_config(str(tmp_path / "config.json"))
    assert spec.arch == arch and spec.name == "debug"
    assert count_params(spec).total == sum(p.numel() for p in model.parameters())


# Public configs (the fields that matter) and the parameter counts their model cards and checkpoints give.
PUBLIC = {
    "Mixtral-8x7B-v0.1": (dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                               num_local_experts=8, num_experts_per_tok=2), 46_702_792_704, 12_879_925_248),
    "Qwen1.5-MoE-A2.7B": (dict(model_type="qwen2_moe", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                               num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, num_experts=60,
                               num_experts_per_tok=4, moe_intermediate_size=1408,
                               shared_expert_intermediate_size=5632), 14_315_784_192, 2_689_173_504),
    "Meta-Llama-3-8B": (dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
                        8_030_261_248, 8_030_261_248),
    "Mistral-7B-v0.1": (dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
                        7_241_732_096, 7_241_732_096),
}


@pytest.mark.parametrize("name", list(PUBLIC))
def test_public_checkpoints_count_and_are_named_after_their_folder(tmp_path, name):
    cfg, total, active = PUBLIC[name]
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    for given in (folder, folder / "config.json"):
        spec = spec_from_hf_config(given)
        assert spec.name == name  # not "config"
        counts = count_params(spec)
        assert (counts.total, counts.active) == (total, active)


def test_head_shapes_transformers_cannot_build_are_refused(tmp_path):
    """Mixtral with hidden 256 and 12 heads planned at head_dim 21, then crashed in transformers' RoPE."""
    with pytest.raises(AdaptiveError, match=r"hidden_size \(256\) is not divisible by num_attention_heads \(12\)"):
        spec_from_hf_config(write(tmp_path, dict(CONFIGS["mixtral"], num_attention_heads=12, num_key_value_heads=4)))
    with pytest.raises(AdaptiveError, match=r"head_dim \(21\) must be even"):
        spec_from_hf_config(write(tmp_path, dict(CONFIGS["mixtral"], head_dim=21)))
    spec = spec_from_hf_config(write(tmp_path, dict(CONFIGS["llama"], num_attention_heads=9, num_key_value_heads=3,
                                                     head_dim=64, hidden_size=360)))
    assert spec.head_dim == 64  # an explicit head_dim with hidden % heads == 0 is fine
