"""Eager attention's extra memory (adaptive/plan/estimate/attention.py) against our model class, counted.

`adaptive fit --attention eager` adds Korthikanti's score-sized term in the form our blocks have it:
6·a·s bytes per token per layer (fp32 softmax output + 16-bit probabilities), GQA's repeated k/v, no
log-sum-exp. Measured here as the difference between the same class built with eager and with SDPA
attention, on fake tensors (adaptive/fidelity/measure.py), dense and MoD, MHA and GQA.
"""

import pytest

from adaptive.fidelity.measure import run_phases
from adaptive.plan import fit, make_request
from adaptive.plan.estimate.attention import eager_extra_saved_bytes, eager_recompute_bytes
from adaptive.plan.architecture.presets import Shape, spec_from_shape


def spec(arch: str, heads: int, kv_heads: int, hidden: int = 256):
    return spec_from_shape(Shape("t", 0, vocab_size=512, hidden_size=hidden, intermediate_size=704, num_hidden_layers=2,
                                 num_attention_heads=heads, num_key_value_heads=kv_heads), arch)


@pytest.mark.parametrize("arch,kv_heads", [("dense", 8), ("dense", 2), ("mod", 8), ("mod", 2)])
def test_eager_keeps_exactly_the_counted_score_tensors(arch, kv_heads):
    s = spec(arch, 8, kv_heads)
    seq, micro = 256, 2
    # plain kernels: the lean loss's backward moment would hide the layers' own backward difference
    sdpa, eager = (run_phases(s, seq, micro, False, attn_implementation=a, kernels="plain") for a in ("sdpa", "eager"))
    predicted = eager_extra_saved_bytes(s, seq, micro)
    assert eager.activations - sdpa.activations == predicted
    # without checkpointing the backward adds nothing score-sized beyond what is saved
    assert eager.backward - sdpa.backward == predicted
    assert predicted > 6 * 8 * seq * seq * micro  # the score term dominates at this sequence


def test_checkpointed_eager_recompute_working_set():
    s = spec("dense", 8, 8)
    seq, micro = 1024, 1
    sdpa, eager = (run_phases(s, seq, micro, True, attn_implementation=a) for a in ("sdpa", "eager"))
    assert eager.activations == sdpa.activations  # full checkpointing keeps layer inputs only
    assert eager.backward - sdpa.backward == pytest.approx(eager_recompute_bytes(s, seq, micro), rel=0.05)


def test_fit_with_eager_attention_adds_the_scores_to_the_plan():
    kw = dict(model="b1", gpu="a100-80gb", zero=2, micro_batch=1, grad_accum=1, checkpointing=False,
              global_batch_tokens=2048, offload="none")
    sdpa, eager = (fit(make_request(attention=a, **kw)).shown for a in ("sdpa", "eager"))
    scores = eager_extra_saved_bytes(eager.setup.spec, 2048, 1)
    assert eager.memory.parts["attention_scores"] == scores and sdpa.memory.parts["attention_scores"] == 0
    assert eager.memory.backward_bytes - sdpa.memory.backward_bytes == scores
