"""The step-time model's per-token bytes, kernel counts and matmul FLOPs (adaptive/plan/estimate/op_times.py) against
the real model classes, counted op by op on the CPU: a TorchDispatchMode sees every aten op of a forward and
backward in bf16; matmuls and attention are set aside, views cost nothing, and every other op moves its inputs' and
outputs' bytes. The shapes here are not the ones the coefficients were counted on."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM
from adaptive.plan.architecture.presets import Shape, spec_from_shape
from adaptive.plan.estimate.op_times import (BWD, FWD, HEAD_BWD, HEAD_FWD, HEAD_KERNELS, HEAD_TABLE_BWD, HEAD_TABLE_FWD,
                                             KERNELS_BWD, KERNELS_FWD, Rates, Work, head_times, layer_times)
from adaptive.plan.hardware.gpus import get_gpu

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addmm_", "_grouped_mm"}
FREE = {"view", "_unsafe_view", "t", "transpose", "expand", "permute", "slice", "select", "unsqueeze", "squeeze",
        "detach", "alias", "as_strided", "split", "split_with_sizes", "unbind", "reshape", "_reshape_alias", "empty",
        "empty_like", "zeros", "ones", "new_empty", "new_zeros", "lift_fresh", "arange", "full", "scalar_tensor"}


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes = self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in FREE:
            self.kernels += 1
            if name not in MATMULS and "attention" not in name:
                self.bytes += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                                  if isinstance(t, torch.Tensor))
        return out


def shape(h, f, heads, kv, layers, vocab=1024):
    return Shape("count", 0, vocab_size=vocab, hidden_size=h, intermediate_size=f, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=512)


def counted(kernels, s, seq, batch):
    """(forward bytes, backward bytes, forward kernels, backward kernels) of one step of the real model."""
    torch.manual_seed(0)
    cfg = AdaptiveConfig.from_spec(spec_from_shape(s, "dense"), kernels=kernels, attn_implementation="sdpa")
    model = AdaptiveForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.randint(0, s.vocab_size, (batch, seq))
    fwd, bwd = OpCount(), OpCount()
    with fwd:
        loss = model(input_ids=ids, labels=ids).loss
    with bwd:
        loss.backward()
    return fwd.bytes, bwd.bytes, fwd.kernels, bwd.kernels


@pytest.mark.parametrize("kernels", ["plain", "lean"])
@pytest.mark.parametrize("h, f, heads, kv, seq, batch", [(448, 1216, 7, 1, 96, 3), (320, 896, 5, 5, 160, 2)])
def test_a_blocks_memory_bound_bytes_and_kernels_are_the_real_ones(kernels, h, f, heads, kv, seq, batch):
    one, two = (counted(kernels, shape(h, f, heads, kv, n), seq, batch) for n in (1, 2))
    tokens, q, kvw = seq * batch, h, kv * h // heads
    per_layer = [b - a for a, b in zip(one, two)]
    fwd = tokens * (FWD[kernels]["attn_h"] * h + FWD[kernels]["rope"] * (q + kvw) + FWD[kernels]["mlp_h"] * h
                    + FWD[kernels]["swiglu"] * f)
    c = BWD[kernels]
    bwd = tokens * (c["attn_h"] * h + c["rope"] * (q + kvw) + c["mlp_h"] * h + c["swiglu"] * f)
    assert per_layer[0] == pytest.approx(fwd, rel=0.03)
    assert per_layer[1] == pytest.approx(bwd, rel=0.03)
    # kernels: the memory-bound ones, 7 GEMMs and attention forward; twice the GEMMs and attention's backward
    assert per_layer[2] == pytest.approx(sum(KERNELS_FWD[kernels].values()) + 7 + 1, abs=2)
    assert per_layer[3] == pytest.approx(sum(KERNELS_BWD[kernels].values()) + 14 + 1, abs=2)


@pytest.mark.parametrize("kernels", ["plain", "lean"])
def test_the_heads_bytes_are_the_real_ones(kernels):
    h, vocab, seq, batch = 384, 6000, 128, 2
    one = counted(kernels, shape(h, 1024, 6, 6, 1, vocab), seq, batch)
    two = counted(kernels, shape(h, 1024, 6, 6, 2, vocab), seq, batch)
    head = [2 * a - b for a, b in zip(one, two)]  # the step less one layer's share
    tokens = seq * batch
    table = vocab * h  # the embedding table's gradient, once per micro-batch
    assert head[0] == pytest.approx(tokens * (HEAD_FWD[kernels][0] * h + HEAD_FWD[kernels][1] * vocab)
                                    + HEAD_TABLE_FWD[kernels] * table, rel=0.03)
    assert head[1] == pytest.approx(tokens * (HEAD_BWD[kernels][0] * h + HEAD_BWD[kernels][1] * vocab)
                                    + HEAD_TABLE_BWD[kernels] * table, rel=0.03)
    fwd_gemms, bwd_gemms = 1, 2 + (kernels == "lean")  # the lean loss recomputes its logits in backward
    assert head[2] == pytest.approx(HEAD_KERNELS[kernels][0] + fwd_gemms, abs=2)
    assert head[3] == pytest.approx(HEAD_KERNELS[kernels][1] + bwd_gemms, abs=2)


def test_the_matmul_flops_are_what_torchs_flop_counter_counts():
    s = shape(384, 1024, 6, 2, 3, vocab=2048)
    seq, batch = 128, 2
    torch.manual_seed(0)
    cfg = AdaptiveConfig.from_spec(spec_from_shape(s, "dense"), kernels="plain", attn_implementation="sdpa")
    model = AdaptiveForCausalLM(cfg)
    ids = torch.randint(0, s.vocab_size, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    per_op = counter.get_flop_counts()["Global"]
    theirs = sum(n for op, n in per_op.items() if op.__name__.split(".")[0] in MATMULS)
    r = Rates(peak_flops=312e12, bytes_per_s=1.7e12, kf=get_gpu("a100-80gb").figures.kernels)
    spec = spec_from_shape(s, "dense")
    w = Work(tokens=seq * batch, seq=seq, tp=1, sp=1, ep=1, capacity_factor=1.0, kernels="plain", attention="sdpa")
    ours = sum(layer_times(spec, t, w, r, phase).matmul_flops for t in spec.layer_types for phase in ("fwd", "bwd"))
    ours += sum(head_times(spec, w, r, phase).matmul_flops for phase in ("fwd", "bwd"))
    assert ours == pytest.approx(theirs, rel=1e-9)
    assert not math.isclose(ours, 0.0)


@pytest.mark.parametrize("arch, tolerance", [("moe", 0.08), ("hybrid", 0.10), ("mod", 0.10)])
def test_routed_blocks_memory_bound_bytes_are_near_the_real_ones(arch, tolerance):
    """MoE dispatch/combine and MoD gather/scatter, on a shape the coefficients were not counted on."""
    h, f, seq, batch = 320, 768, 96, 3

    def step(layers):
        torch.manual_seed(0)
        spec = spec_from_shape(shape(h, f, 5, 5, layers), arch)
        model = AdaptiveForCausalLM(AdaptiveConfig.from_spec(spec, kernels="lean", attn_implementation="sdpa"))
        model = model.to(torch.bfloat16)
        ids = torch.randint(0, 1024, (batch, seq))
        fwd, bwd = OpCount(), OpCount()
        with fwd:
            loss = model(input_ids=ids, labels=ids).loss
        with bwd:
            loss.backward()
        return (fwd.bytes, bwd.bytes), spec

    (two, _), (four, spec) = step(2), step(4)
    r = Rates(peak_flops=312e12, bytes_per_s=1.0, kf=get_gpu("a100-80gb").figures.kernels)  # seconds = bytes
    w = Work(tokens=seq * batch, seq=seq, tp=1, sp=1, ep=1, capacity_factor=1.0, kernels="lean", attention="sdpa")
    for i, phase in enumerate(("fwd", "bwd")):
        ours = sum(layer_times(spec, t, w, r, phase).memory_s for t in spec.layer_types[2:4])
        assert four[i] - two[i] == pytest.approx(ours, rel=tolerance), phase


def test_native_gpt2_bytes_are_transformers_gpt2_under_autocast():
    """The "native" family (a GPT-2 of PyTorch's own LayerNorm and GELU kernels, fp32 weights under autocast, as
    single-GPU training scripts run it): per-layer bytes, the weights' casts included, on transformers' GPT-2."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from adaptive.plan.estimate.op_times import AUTOCAST_CAST_BYTES_PER_PARAM

    h, heads, seq, batch = 448, 7, 80, 3

    def step(layers):
        torch.manual_seed(0)
        cfg = GPT2Config(n_embd=h, n_head=heads, n_layer=layers, vocab_size=1500, n_positions=seq,
                         activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(cfg)
        ids = torch.randint(0, 1500, (batch, seq))
        fwd, bwd = OpCount(), OpCount()
        with torch.autocast("cpu", dtype=torch.bfloat16), fwd:
            loss = model(input_ids=ids, labels=ids).loss
        with bwd:
            loss.backward()
        return fwd.bytes, bwd.bytes

    one, two = step(1), step(2)
    tokens, layer_params = seq * batch, 12 * h * h  # GPT-2's block: 4h^2 attention, 8h^2 MLP (biases aside)
    casts = AUTOCAST_CAST_BYTES_PER_PARAM["native"] / 2 * layer_params  # each phase casts the block's weights once
    for i, c in enumerate((FWD["native"], BWD["native"])):
        ours = tokens * (c["attn_h"] + c["mlp_h"]) * h + casts
        assert two[i] - one[i] == pytest.approx(ours, rel=0.03), i
