"""The model used the ways transformers users use models: loading info, `outputs[0]`, beam search, attention maps,
static caches, padded and packed batches. Each test names the behaviour a common transformers idiom relies on."""

from __future__ import annotations

import pytest
import torch
from _model_helpers import tiny_model
from transformers import AutoModelForCausalLM

from adaptive.errors import AdaptiveError

PAD = 0
ROUTED = ("mod", "hybrid")


def ids_batch(batch: int = 2, seq: int = 9, seed: int = 5) -> torch.Tensor:
    return torch.randint(1, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def eager(model):
    model.config._attn_implementation = "eager"
    return model


def test_from_pretrained_with_output_loading_info_returns_model_and_info(arch, tmp_path):
    tiny_model(arch).save_pretrained(tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(model).__name__ == "AdaptiveForCausalLM"
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()


def test_outputs_zero_is_the_logits_without_labels_and_the_loss_with_them(arch):
    model = tiny_model(arch).eval()
    ids = ids_batch()
    out = model(ids)
    assert torch.equal(out[0], out.logits)
    assert torch.equal(model(ids, return_dict=False)[0], out.logits)
    with_labels = model(ids, labels=ids)
    assert torch.equal(with_labels[0], with_labels.loss)
    assert torch.equal(with_labels[1], with_labels.logits)
    if arch != "dense":
        assert with_labels.aux_loss is not None  # still there, just not first


@pytest.mark.parametrize("arch", ROUTED)
def test_beam_search_when_a_routed_layer_cached_nothing(arch):
    model = tiny_model(arch, pad_token_id=PAD).eval()
    first_routed = model.config.mod_layers[0]
    with torch.no_grad():
        model.model.layers[first_routed].mod.router.weight.zero_()  # causal logit 0: this layer routes nothing
    ids = ids_batch()
    kwargs = dict(num_beams=3, max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    out = model.generate(ids, use_cache=True, return_dict_in_generate=True, **kwargs)
    assert out.cache.layers[first_routed].keys is None  # the case that crashed: tokens seen, no keys stored
    assert out.cache.layers[first_routed].get_seq_length() > 0
    assert torch.equal(out.sequences, model.generate(ids, use_cache=False, **kwargs))


@pytest.mark.parametrize("arch", ROUTED)
def test_routed_attention_maps_are_full_with_zeros_for_skipped_tokens(arch):
    model = eager(tiny_model(arch, pad_token_id=PAD)).eval()
    ids = ids_batch(seq=12)
    out = model(ids, output_attentions=True, output_hidden_states=True, use_cache=True)
    heads = model.config.num_attention_heads
    for i in model.config.mod_layers:
        attn = out.attentions[i]
        assert attn.shape == (2, heads, 12, 12)
        routed = model.model.layers[i].mod.router(out.hidden_states[i]).squeeze(-1) > 0
        assert routed.any() and not routed.all()  # both kinds present, so the checks below can fail
        skipped = ~routed
        assert attn.transpose(1, 2)[skipped].abs().sum() == 0  # rows of skipped tokens
        assert attn.permute(0, 3, 1, 2)[skipped].abs().sum() == 0  # columns of skipped tokens
        torch.testing.assert_close(attn.sum(-1).transpose(1, 2)[routed], torch.ones(int(routed.sum()), heads))
        assert torch.equal(attn, attn.tril())  # causal in token order
    step = model(ids_batch(seq=1, seed=6), cache=out.cache, output_attentions=True)
    assert all(a.shape == (2, heads, 1, 13) for a in step.attentions)


def test_a_routed_layer_that_routes_nothing_returns_a_zero_map():
    model = eager(tiny_model("mod")).eval()
    layer = model.config.mod_layers[0]
    with torch.no_grad():
        model.model.layers[layer].mod.router.weight.zero_()
    attn = model(ids_batch(), output_attentions=True).attentions[layer]
    assert attn is not None and attn.shape == (2, model.config.num_attention_heads, 9, 9)
    assert attn.abs().sum() == 0


@pytest.mark.parametrize("arch", ROUTED)
def test_assisted_generation_returns_attentions(arch):
    model = eager(tiny_model(arch, pad_token_id=PAD)).eval()
    assistant = eager(tiny_model(arch, seed=1, pad_token_id=PAD)).eval()
    ids = ids_batch(batch=1)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    out = model.generate(ids, assistant_model=assistant, output_attentions=True, return_dict_in_generate=True,
                         **kwargs)
    assert torch.equal(out.sequences, model.generate(ids, **kwargs))  # greedy assisted == greedy
    assert all(a is not None and a.dim() == 4 for step in out.attentions for a in step)


def test_padding_does_not_change_mod_routing():
    # training (top-k) routing: k comes from the row's real tokens, so right padding changes nothing
    model = tiny_model("mod", mod_capacity=0.5, pad_token_id=PAD).train()
    short = ids_batch(batch=1, seq=6)
    padded = torch.cat([short, torch.full((1, 10), PAD)], dim=1)
    mask = (torch.arange(16) < 6).long()[None]
    alone, batched = model(short), model(padded, attention_mask=mask)
    torch.testing.assert_close(batched.logits[:, :6], alone.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched.router_stats.mod_skip_rate, alone.router_stats.mod_skip_rate)
    assert torch.allclose(alone.router_stats.mod_skip_rate, torch.tensor(0.5))  # ceil(0.5 * 6) = 3 of 6 routed


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_static_cache_generation_matches_the_dynamic_cache(arch):
    model = tiny_model(arch, pad_token_id=PAD).eval()
    ids = ids_batch()
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = PAD, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    static = model.generate(ids, cache_implementation="static", **kwargs)
    assert torch.equal(static, model.generate(ids, **kwargs))


@pytest.mark.parametrize("arch", ROUTED)
def test_static_cache_is_refused_on_routed_models_in_one_line(arch):
    model = tiny_model(arch).eval()
    with pytest.raises(AdaptiveError, match="DynamicCache") as err:
        model.generate(ids_batch(), cache_implementation="static", max_new_tokens=2, pad_token_id=PAD)
    assert "\n" not in str(err.value)


def packed_batch() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Two sequences (5 and 7 tokens) packed into one row, DataCollatorWithFlattening-style."""
    first, second = ids_batch(1, 5, seed=1), ids_batch(1, 7, seed=2)
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    return torch.cat([first, second], dim=1), positions, [first, second]


@pytest.mark.parametrize("arch", ROUTED)
def test_packed_sequences_are_refused_on_routed_models(arch):
    model = tiny_model(arch).train()
    ids, positions, _ = packed_batch()
    with pytest.raises(AdaptiveError, match="packed sequences") as err:
        model(ids, position_ids=positions)
    assert "\n" not in str(err.value)
    model(ids, position_ids=torch.arange(12)[None])  # plain positions pass


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_packed_sequences_equal_separate_sequences_without_routing(arch):
    model = tiny_model(arch).eval()
    ids, positions, parts = packed_batch()
    # transformers builds the block-diagonal mask from restarting position ids when there is no cache (training)
    packed = model(ids, position_ids=positions, use_cache=False).logits
    separate = torch.cat([model(p).logits for p in parts], dim=1)
    torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ROUTED)
def test_left_padded_generation_positions_are_not_taken_for_packing(arch):
    model = tiny_model(arch, pad_token_id=PAD).eval()
    ids = ids_batch()
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = PAD, 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # what generate() builds
    model(ids, attention_mask=mask, position_ids=positions)


def test_batched_and_single_row_outputs_agree(arch):
    # transformers' test_batching_equivalence minus the batch statistics (router_stats, aux_loss), which are
    # aggregates of the whole batch by definition
    model = eager(tiny_model(arch, pad_token_id=PAD)).eval()
    ids = ids_batch(batch=3, seq=8)
    mask = torch.tril(torch.ones(3, 8, dtype=torch.long))[-3:]  # rows of 6, 7 and 8 real tokens
    ids = ids.masked_fill(mask == 0, PAD)
    batched = model(ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    for row in range(3):
        single = model(ids[row:row + 1], attention_mask=mask[row:row + 1], output_hidden_states=True,
                       output_attentions=True)
        real = mask[row].bool()
        torch.testing.assert_close(single.logits[0, real], batched.logits[row, real], rtol=1e-5, atol=1e-5)
        for a, b in zip(single.hidden_states, batched.hidden_states):
            torch.testing.assert_close(a[0, real], b[row, real], rtol=1e-5, atol=1e-5)
        for a, b in zip(single.attentions, batched.attentions):
            torch.testing.assert_close(a[0][:, real][:, :, real], b[row][:, real][:, :, real], rtol=1e-5, atol=1e-5)
