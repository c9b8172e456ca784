"""Issue 11's done-when figures for the lean kernels, measured on fake tensors (no memory) and planned.

- the loss path at Llama-3's vocabulary (128,256) and sequence 8192 holds at most 1/8 of the plain path's
  `logits_and_loss` + `backward_transient` bytes, measured, and `fit`'s parts say so;
- `fit` plans llm-foundry's published MPT-7B run (8 x A100-80GB, ZeRO-3, micro-batch 6, sequence 2048, no
  checkpointing) as fitting, and its memory parts agree with `adaptive measure` of the lean model within 5%.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from adaptive.fidelity.compare import compare
from adaptive.fidelity.measure import PeakBytes
from adaptive.plan.hardware.gpus import get_gpu
from adaptive.plan.estimate.memory import TrainSetup, estimate_memory
from adaptive.plan.search.planner import FitRequest, fit
from adaptive.plan.architecture.presets import Shape, preset_spec, spec_from_shape

LLAMA3_VOCAB = 128_256
SEQ = 8192


def loss_path_peak_bytes(kernels: str, hidden_size: int, vocab: int, seq: int) -> int:
    """Peak live bytes of LM head + loss, forward and backward, above its input and weight (the gradients of
    both included), the way our model runs it in training."""
    from adaptive.models.lean import LeanLMHead, lean_causal_lm_loss
    from transformers.loss.loss_utils import ForCausalLMLoss

    with FakeTensorMode():
        tracker = PeakBytes()
        with tracker:
            head = LeanLMHead(hidden_size, vocab, bias=False, dtype=torch.bfloat16)
            hidden = torch.randn(1, seq, hidden_size, dtype=torch.bfloat16, requires_grad=True)
            labels = torch.randint(0, vocab, (1, seq))
            base = tracker.current
            tracker.reset_peak()
            if kernels == "lean":
                loss = lean_causal_lm_loss(head, hidden, labels)
            else:
                logits = head(hidden)
                loss = ForCausalLMLoss(logits, labels, vocab)
                del logits  # the training loop drops the output's logits before backward
            loss.backward()
            return tracker.peak - base


def planned_parts(kernels: str, spec) -> dict[str, int]:
    return estimate_memory(TrainSetup(spec, SEQ, 1, 2, False, False, False, kernels=kernels)).parts


def test_lean_loss_path_holds_an_eighth_of_the_plain_one_at_llama3_vocab_and_seq_8192():
    spec = replace(preset_spec("b7", "dense"), vocab_size=LLAMA3_VOCAB)  # hidden 4096, as Llama-3-8B
    measured = {k: loss_path_peak_bytes(k, spec.hidden_size, LLAMA3_VOCAB, SEQ) for k in ("plain", "lean")}
    plain, lean = planned_parts("plain", spec), planned_parts("lean", spec)
    today = plain["logits_and_loss"] + plain["backward_transient"]  # the log-softmax + the loss's backward
    assert measured["lean"] <= today / 8 and measured["lean"] <= measured["plain"] / 8, (measured, today)
    # fit's parts are these measurements: today's loss parts are the plain loss path, and the lean loss
    # path is the lean plan's logits_and_loss part (a tile of logits, the head's input and weight gradients)
    assert today == pytest.approx(measured["plain"], rel=0.05)
    assert lean["logits_and_loss"] == pytest.approx(measured["lean"], rel=0.05)
    assert lean["logits_and_loss"] <= today / 8


# MPT-7B (llm-foundry's mpt-7b.yaml): d_model 4096, 32 heads, 32 layers, vocabulary 50,368. Its MLP is a
# GELU MLP of width 4·d (2·4096·16384 weights); our blocks are SwiGLU, so the same weights per layer make
# width 16384·2/3 = 10922.67, rounded up to Llama-7B's 11008 (6.7B parameters in all, as MPT-7B).
MPT_7B = Shape("mpt-7b", 6.7e9, vocab_size=50368, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048)


def mpt_request(gpus: int) -> FitRequest:
    return FitRequest(spec=spec_from_shape(MPT_7B, "dense"), gpu=get_gpu("a100-80gb"), gpus_per_node=gpus,
                      seq_len=2048, zero_stage=3, offload="none", micro_batch_size=6, gradient_checkpointing=False,
                      tp_size=1, sp_size=1)  # llm-foundry's run: data parallel (FSDP) only


def test_fit_plans_llm_foundrys_mpt_7b_run_and_measure_agrees():
    plan = fit(mpt_request(8), suggest=False)
    chosen = plan.shown
    assert plan.fits and chosen.setup.micro_batch_size == 6 and not chosen.setup.gradient_checkpointing
    assert chosen.setup.zero_stage == 3 and chosen.setup.kernels == "lean"
    plain = fit(replace(mpt_request(8), kernels="plain"), suggest=False)
    assert not plain.fits  # the plain ops are what made this run OOM in the plan before

    report = compare(mpt_request(1), "mpt-7b", zero_stage=3, micro_batch=6)
    for part in report.parts:
        assert abs(part.error) <= 0.05, part
    # the 8-GPU plan's activation-side parts are the ones compared (they do not depend on the GPU count)
    compared = report.setup
    one_gpu = estimate_memory(compared).parts
    for key in ("activations", "logits_and_loss", "backward_transient"):
        assert chosen.memory.parts[key] == one_gpu[key], key
