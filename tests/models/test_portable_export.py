"""Exports the ecosystem loads: dense -> llama, plain MoE -> mixtral, the rest stays adaptive (and says why)."""

from __future__ import annotations

import json

import pytest
import torch
from _model_helpers import PAD, prompts, tiny_model
from transformers import AutoModelForCausalLM, LlamaForCausalLM, MixtralForCausalLM

from adaptive.errors import AdaptiveError
from adaptive.models.export import choose_format, export_pretrained


def moe_model(**overrides):
    # every block MoE, as Mixtral; eval_capacity_factor None (the default) drops nothing in inference
    return tiny_model("moe", block_types=["moe"] * 5, pad_token_id=PAD, **overrides).eval()


def generate(model, ids, mask):
    return model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD,
                          eos_token_id=None)


@pytest.mark.parametrize("tied", [False, True])
def test_dense_exports_as_llama_with_identical_logits_and_tokens(tmp_path, tied):
    ours = tiny_model("dense", pad_token_id=PAD, tie_word_embeddings=tied).eval()
    chosen = export_pretrained(ours, tmp_path)
    assert chosen.format == "llama"
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs) is LlamaForCausalLM
    ids, mask = prompts()
    with torch.no_grad():
        assert torch.equal(theirs(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits)
    assert torch.equal(generate(theirs, ids, mask), generate(ours, ids, mask))


def test_moe_exports_as_mixtral_with_the_same_logits_and_tokens(tmp_path):
    ours = moe_model()
    chosen = export_pretrained(ours, tmp_path)
    assert chosen.format == "mixtral"
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs) is MixtralForCausalLM
    ids, mask = prompts()
    with torch.no_grad():
        expected, got = ours(ids, attention_mask=mask).logits, theirs(ids, attention_mask=mask).logits
    # the experts' outputs are summed in a different order (Mixtral: index_add per expert), so the last bit may differ
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert torch.equal(generate(theirs, ids, mask), generate(ours, ids, mask))


def test_a_selection_bias_in_use_keeps_our_class_and_says_why(tmp_path):
    ours = moe_model()
    with torch.no_grad():
        ours.moe_gates()[2].e_score_correction_bias[3] = 0.01
    chosen = export_pretrained(ours, tmp_path)
    assert chosen.format == "adaptive"
    assert "selection bias" in chosen.reason and "not representable in Mixtral" in chosen.reason
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)).__name__ == "AdaptiveForCausalLM"
    with pytest.raises(AdaptiveError, match="cannot export as mixtral: the expert selection bias"):
        export_pretrained(ours, tmp_path / "forced", requested="mixtral")


@pytest.mark.parametrize(("arch", "why"), [("mod", "MoD routing"), ("hybrid", "MoD routing"),
                                           ("moe", "Mixtral has an MoE MLP in every block")])
def test_routed_and_mixed_models_stay_adaptive(arch, why):
    blocks = ["dense", "moe", "dense", "moe", "dense"] if arch == "moe" else None  # MoE every other block
    config = tiny_model(arch, **({"block_types": blocks} if blocks else {})).config
    chosen = choose_format(config)
    assert chosen.format == "adaptive" and why in chosen.reason
    with pytest.raises(AdaptiveError, match="cannot export as llama"):
        choose_format(config, requested="llama")


@pytest.mark.parametrize(("overrides", "why"), [
    (dict(num_experts_per_tok=1), "top-1"),
    (dict(eval_capacity_factor=1.0), "drops tokens in inference"),
    (dict(top2_2nd_expert_sampling=True), "samples the second expert"),
])
def test_moe_routing_mixtral_cannot_reproduce_stays_adaptive(overrides, why):
    chosen = choose_format(moe_model(**overrides).config)
    assert chosen.format == "adaptive" and why in chosen.reason
