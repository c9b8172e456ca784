"""HF round trip (safetensors, AutoModelForCausalLM) and greedy generation with and without the KV cache."""

from __future__ import annotations

import pytest
import torch
from _model_helpers import PAD, prompts, tiny_model
from transformers import AutoModelForCausalLM

from adaptive.models.mod import RoutedCacheLayer


def test_save_pretrained_round_trips_to_the_same_logits(arch, tmp_path):
    model = tiny_model(arch, mod_predictor_hidden_size=8 if arch == "hybrid" else 0).eval()
    with torch.no_grad():
        for gate in model.moe_gates():
            gate.e_score_correction_bias.normal_()  # carried by the checkpoint too
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    assert loaded.config.to_spec() == model.config.to_spec()
    ids, mask = prompts()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        got = loaded(ids, attention_mask=mask).logits
    # not bitwise: safetensors hands out unaligned views, so CPU kernels may round the last bit differently
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


@pytest.mark.parametrize("batch", ["single", "left_padded"])
def test_greedy_generate_is_the_same_with_and_without_cache(arch, batch):
    model = tiny_model(arch, pad_token_id=PAD, mod_predictor_hidden_size=8 if arch == "hybrid" else 0).eval()
    ids, mask = prompts()
    if batch == "single":
        ids, mask = ids[:1], mask[:1]
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    with_cache = model.generate(ids, use_cache=True, **kwargs)
    without_cache = model.generate(ids, use_cache=False, **kwargs)
    assert with_cache.shape == (ids.shape[0], ids.shape[1] + 10)
    assert torch.equal(with_cache, without_cache)


def test_mod_cache_holds_keys_of_routed_tokens_only():
    model = tiny_model("mod", pad_token_id=PAD).eval()
    ids, mask = prompts()
    out = model(ids, attention_mask=mask, use_cache=True)
    routed_layer = model.config.mod_layers[0]
    layer = out.cache.layers[routed_layer]
    assert isinstance(layer, RoutedCacheLayer)
    assert layer.get_seq_length() == ids.shape[1]  # tokens seen, not keys stored
    # recompute the causal decision of that layer from its input
    hidden = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states[routed_layer]
    routed = (model.model.layers[routed_layer].mod.router(hidden).squeeze(-1) > 0) & mask.bool()
    for row in range(2):
        cached = layer.slots[row][layer.key_valid[row]].tolist()
        assert cached == routed[row].nonzero().flatten().tolist()
    assert layer.keys.shape[2] == int(routed.sum(1).max())


def test_tied_embeddings_stay_tied_through_save_and_load(tmp_path):
    model = tiny_model("hybrid", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_generate_when_the_first_layer_is_routed():
    # the cache's sequence length (position ids, dense-layer masks) then comes from a RoutedCacheLayer
    model = tiny_model("hybrid", pad_token_id=PAD, block_types=["hybrid", "dense", "mod", "moe", "dense"]).eval()
    ids, mask = prompts()
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    assert torch.equal(model.generate(ids, use_cache=True, **kwargs), model.generate(ids, use_cache=False, **kwargs))
