"""Generation modes transformers' GenerationTesterMixin checks, as our own tests (that mixin lives only in
transformers' repository): dict outputs with scores, attentions and hidden states, beam search, sampling,
assisted decoding, inputs_embeds, with and without the KV cache, for every architecture."""

from __future__ import annotations

import pytest
import torch
from _model_helpers import tiny_model

PAD = 0
NEW = 5


def model_and_prompt(arch: str, batch: int = 2):
    model = tiny_model(arch, pad_token_id=PAD, mod_predictor_hidden_size=8 if arch == "hybrid" else 0).eval()
    model.config._attn_implementation = "eager"  # attention maps are returned only by eager attention
    ids = torch.randint(1, 128, (batch, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[1, :2], mask[1, :2] = PAD, 0
    return model, ids, mask


def kwargs(mask, new: int = NEW, **extra):
    return dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, pad_token_id=PAD, eos_token_id=None,
                **extra)


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_dict_output_has_scores_attentions_and_hidden_states_per_step(arch, use_cache):
    model, ids, mask = model_and_prompt(arch)
    out = model.generate(ids, do_sample=False, use_cache=use_cache, return_dict_in_generate=True,
                         output_scores=True, output_logits=True, output_attentions=True, output_hidden_states=True,
                         **kwargs(mask))
    config, batch, prompt = model.config, ids.shape[0], ids.shape[1]
    assert out.sequences.shape == (batch, prompt + NEW)
    assert len(out.scores) == len(out.logits) == len(out.attentions) == len(out.hidden_states) == NEW
    for step in range(NEW):
        assert out.scores[step].shape == (batch, config.vocab_size)
        # the chosen token is the argmax of the step's scores (greedy)
        assert torch.equal(out.scores[step].argmax(-1), out.sequences[:, prompt + step])
        queries = 1 if step and use_cache else prompt + step  # without a cache every step re-reads it all
        keys = prompt + step
        assert len(out.attentions[step]) == config.num_hidden_layers
        for attn in out.attentions[step]:
            assert attn.shape == (batch, config.num_attention_heads, queries, keys)
        assert len(out.hidden_states[step]) == config.num_hidden_layers + 1
        assert out.hidden_states[step][-1].shape == (batch, queries, config.hidden_size)


def test_beam_search_is_the_same_with_and_without_cache(arch):
    model, ids, mask = model_and_prompt(arch)
    beam = dict(num_beams=3, num_return_sequences=2, do_sample=False, return_dict_in_generate=True,
                output_scores=True)
    with_cache = model.generate(ids, use_cache=True, **kwargs(mask, **beam))
    without = model.generate(ids, use_cache=False, **kwargs(mask, **beam))
    assert with_cache.sequences.shape == (ids.shape[0] * 2, ids.shape[1] + NEW)
    assert torch.equal(with_cache.sequences, without.sequences)
    torch.testing.assert_close(with_cache.sequences_scores, without.sequences_scores, rtol=1e-5, atol=1e-5)


def test_sampling_is_the_same_with_and_without_cache(arch):
    model, ids, mask = model_and_prompt(arch)
    runs = []
    for use_cache in (True, False):
        torch.manual_seed(11)
        runs.append(model.generate(ids, do_sample=True, top_k=20, use_cache=use_cache, **kwargs(mask)))
    assert torch.equal(*runs)


def test_assisted_decoding_gives_the_greedy_tokens(arch):
    model, ids, mask = model_and_prompt(arch, batch=1)  # assisted decoding takes one sequence
    assistant = tiny_model(arch, seed=1, pad_token_id=PAD).eval()
    assisted = model.generate(ids, assistant_model=assistant, do_sample=False, **kwargs(mask))
    assert torch.equal(assisted, model.generate(ids, do_sample=False, **kwargs(mask)))


def test_prompt_lookup_decoding_gives_the_greedy_tokens(arch):
    model, ids, mask = model_and_prompt(arch, batch=1)
    looked_up = model.generate(ids, prompt_lookup_num_tokens=2, do_sample=False, **kwargs(mask))
    assert torch.equal(looked_up, model.generate(ids, do_sample=False, **kwargs(mask)))


def test_generate_from_inputs_embeds_continues_like_input_ids(arch):
    model, ids, mask = model_and_prompt(arch)
    embeds = model.get_input_embeddings()(ids)
    from_embeds = model.generate(inputs_embeds=embeds, do_sample=False, **kwargs(mask))
    from_ids = model.generate(ids, do_sample=False, **kwargs(mask))
    assert from_embeds.shape == (ids.shape[0], NEW)  # only new tokens: there are no prompt ids to echo
    assert torch.equal(from_embeds, from_ids[:, ids.shape[1]:])


def test_continuing_from_a_returned_cache_matches_one_call(arch):
    model, ids, mask = model_and_prompt(arch)
    first = model.generate(ids, do_sample=False, return_dict_in_generate=True, **kwargs(mask))
    longer_mask = torch.cat([mask, torch.ones(mask.shape[0], NEW, dtype=mask.dtype)], dim=1)
    second = model.generate(first.sequences, cache=first.cache, do_sample=False, **kwargs(longer_mask))
    once = model.generate(ids, do_sample=False, **kwargs(mask, new=2 * NEW))
    assert torch.equal(second, once)
