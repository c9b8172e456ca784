"""transformers' attention switch (sdpa default, eager) gives the same model, including the routed layers' masks;
beam search reorders the routed KV cache correctly."""

from __future__ import annotations

import pytest
import torch
from _model_helpers import tiny_config, tiny_model

from adaptive.models import AdaptiveForCausalLM


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_eager_and_sdpa_agree(arch, mode):
    # no token dropping: padded positions hold different garbage under the two kernels, and in training they
    # compete for expert capacity like any token
    sdpa = tiny_model(arch, pad_token_id=0, drop_tokens=False)
    eager = AdaptiveForCausalLM(tiny_config(arch, pad_token_id=0, drop_tokens=False, attn_implementation="eager"))
    eager.load_state_dict(sdpa.state_dict())
    assert (sdpa.config._attn_implementation, eager.config._attn_implementation) == ("sdpa", "eager")
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    for model in (sdpa, eager):
        model.train(mode == "train")
    a = sdpa(ids, attention_mask=mask, use_cache=True)
    b = eager(ids, attention_mask=mask, use_cache=True)
    real = mask.bool()
    torch.testing.assert_close(b.logits[real], a.logits[real], rtol=1e-5, atol=1e-5)
    step = torch.randint(1, 128, (2, 1))
    mask = torch.cat([mask, torch.ones_like(step)], dim=1)
    torch.testing.assert_close(eager(step, attention_mask=mask, cache=b.cache).logits,
                               sdpa(step, attention_mask=mask, cache=a.cache).logits, rtol=1e-5, atol=1e-5)


def test_beam_search_is_the_same_with_and_without_cache():
    model = tiny_model("hybrid", pad_token_id=0).eval()
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(model.generate(ids, use_cache=True, **kwargs), model.generate(ids, use_cache=False, **kwargs))
