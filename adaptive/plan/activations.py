"""Activation memory of our decoder blocks, counted tensor by tensor, in bytes.

Korthikanti et al. (2022) give ~34·s·b·h bytes per layer for a GPT block. Our blocks differ (RMSNorm
in fp32, GQA, RoPE, SwiGLU, SDPA, an fp32 MoE router with capacity slots, MoD gather/scatter), so each
term below names the tensors autograd saves for them. The sums equal `saved_tensors_hooks` counts of
the real model classes (tests/fidelity), and `adaptive measure` re-measures them for any shape.

Notation, per token unless noted: h hidden, q = heads·head_dim, kv = kv_heads·head_dim, f SwiGLU
width, E experts, k experts per token, V vocabulary. 16-bit activations (2 bytes), fp32 where the
model computes in fp32.
"""

from __future__ import annotations

import math
from functools import lru_cache

from adaptive.plan.presets import ModelSpec

MIN_CAPACITY = 4  # DeepSpeed's and our MoE gate's default floor on expert capacity


def attention_half_bytes(s: ModelSpec) -> int:
    """Input RMSNorm (fp32 copy 4h, 1/rms 4, 16-bit cast 2h, output 2h kept by q/k/v projections),
    post-RoPE q and k, v, the SDPA output (2 bytes each) and its fp32 log-sum-exp per head."""
    h, q, kv = s.hidden_size, s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    return 8 * h + 4 + 4 * q + 4 * kv + 4 * s.num_attention_heads


def dense_layer_bytes(s: ModelSpec) -> int:
    """Attention half + post-attention RMSNorm (8h + 4) + SwiGLU (gate, silu(gate), up, product: 8f)."""
    return attention_half_bytes(s) + 8 * s.hidden_size + 4 + 8 * s.intermediate_size


def expert_capacity(tokens: int, s: ModelSpec, capacity_factor: float) -> int:
    """Slots per expert: ceil(tokens / E · capacity_factor · k), at least MIN_CAPACITY."""
    e, k = s.num_local_experts, s.num_experts_per_tok
    return max(math.ceil(tokens / e * capacity_factor * k), MIN_CAPACITY)


def moe_layer_bytes(s: ModelSpec, tokens: int, capacity_factor: float) -> float:
    """Bytes of one MoE layer that `tokens` tokens enter (attention half included).

    Per token: the RMSNorm before the router keeps its fp32 copy, 1/rms and 16-bit cast (6h + 4; its
    output is gathered, not kept); the router input in fp32 (4h); fp32 logits and softmax (8E) and a
    bool mask (E); routing indices, weights and masks (31k bytes for top-k); the combine's gathered
    expert outputs (2kh). Per capacity slot (E·C of them): the dispatched input (2h), the expert's
    SwiGLU (8f) and the slot's source index (8). Per layer: the fp32 copy of the router weight (4Eh).
    A Qwen2-MoE shared expert adds its SwiGLU over every token (8 bytes per unit of its width; measured
    slope 8.00 on transformers' class; its sigmoid gate's few bytes are within the router terms' error).
    """
    h, e, k, f = s.hidden_size, s.num_local_experts, s.num_experts_per_tok, s.moe_intermediate_size
    slots = e * expert_capacity(tokens, s, capacity_factor)
    per_token = (attention_half_bytes(s) + 6 * h + 4 + 4 * h + 9 * e + 4 + 31 * k + 2 * k * h
                 + 8 * s.shared_expert_intermediate_size)
    return tokens * per_token + slots * (2 * h + 8 * f + 8) + 4 * e * h + 4 * e + 8


def mod_selected(s: ModelSpec, seq_len: int) -> int:
    return math.ceil(s.mod_capacity * seq_len)


def layer_bytes(s: ModelSpec, layer_type: str, seq_len: int, micro_batch: int, capacity_factor: float) -> float:
    """Saved bytes of one layer for a micro-batch, without checkpointing."""
    tokens = seq_len * micro_batch
    if layer_type == "dense":
        return tokens * dense_layer_bytes(s)
    if layer_type == "moe":
        return moe_layer_bytes(s, tokens, capacity_factor)
    # MoD-routed: over all tokens, the router input (2h), 16-bit logit (2) and fp32 BCE terms (8);
    # over the selected tokens, the block (dense or MoE) plus gathered RoPE cos/sin (4·head_dim),
    # two index tensors and the router weight (18) and the weighted output delta (2h).
    selected = micro_batch * mod_selected(s, seq_len)
    routing = tokens * (2 * s.hidden_size + 10) + selected * (4 * s.head_dim + 18 + 2 * s.hidden_size)
    if layer_type == "mod":
        return routing + selected * dense_layer_bytes(s)
    return routing + moe_layer_bytes(s, selected, capacity_factor)


def head_bytes(s: ModelSpec, seq_len: int, micro_batch: int) -> int:
    """Outside the layers: token ids (8), final RMSNorm (8h + 4), the loss's fp32 log-softmax (4V)
    and targets (8); RoPE cos/sin once per position (4·head_dim, shared by all layers)."""
    tokens = seq_len * micro_batch
    return tokens * (8 * s.hidden_size + 4 * s.vocab_size + 20) + 4 * s.head_dim * seq_len


@lru_cache(maxsize=4096)
def activation_bytes(s: ModelSpec, seq_len: int, micro_batch: int, checkpointing: bool,
                     capacity_factor: float = 1.0) -> int:
    """Bytes autograd holds at the end of the forward pass (logits' log-softmax included)."""
    tokens = seq_len * micro_batch
    if checkpointing:
        # full checkpointing keeps each layer's input only; RoPE tables are recomputed with the layer
        layers = len(s.layer_types) * tokens * 2 * s.hidden_size
        return int(layers + tokens * (8 * s.hidden_size + 4 * s.vocab_size + 20))
    layers = sum(layer_bytes(s, t, seq_len, micro_batch, capacity_factor) for t in s.layer_types)
    return int(layers + head_bytes(s, seq_len, micro_batch))


def moe_backward_bytes(s: ModelSpec, tokens: int, capacity_factor: float) -> float:
    """Working set of one MoE layer's backward, fitted to measurements of random shapes: gradients of
    the gathered tokens (2.8h per token) and of the dispatched capacity slots (5.6h per slot)."""
    slots = s.num_local_experts * expert_capacity(tokens, s, capacity_factor)
    return 2.8 * tokens * s.hidden_size + 5.6 * slots * s.hidden_size


def backward_peak_bytes(s: ModelSpec, seq_len: int, micro_batch: int, checkpointing: bool,
                        capacity_factor: float = 1.0) -> int:
    """Activation-side bytes at the peak of backward: saved tensors plus the working set.

    Measured (tests/fidelity): the loss's backward adds 8 bytes per logit (the fp32 gradient of the
    logits and its 16-bit cast) while the rest is still saved. An MoE layer's backward can exceed that
    (`moe_backward_bytes`), the loss's log-softmax being freed by then. With checkpointing a layer's
    recomputed activations and their gradients come on top of the kept layer inputs (dense: its saved
    bytes + 8h + 2.5f per token).
    """
    tokens = seq_len * micro_batch
    saved = activation_bytes(s, seq_len, micro_batch, checkpointing, capacity_factor)
    loss_peak = saved + tokens * 8 * s.vocab_size
    selected = micro_batch * mod_selected(s, seq_len)

    def working(layer_type: str) -> float:
        if layer_type == "moe":
            return moe_backward_bytes(s, tokens, capacity_factor)
        if layer_type == "hybrid":
            return moe_backward_bytes(s, selected, capacity_factor)
        f = s.intermediate_size
        return tokens * (8 * s.hidden_size + 2.5 * f) if checkpointing else 0.0

    types = set(s.layer_types)
    if not checkpointing:
        # the top MoE layer's backward runs while 6.5 bytes per logit of the loss's backward remain
        layer_peak = saved + tokens * 6.5 * s.vocab_size + max(working(t) for t in types)
        return int(max(loss_peak, layer_peak))
    inputs = len(s.layer_types) * tokens * 2 * s.hidden_size + tokens * (8 * s.hidden_size + 20)
    recompute = max(layer_bytes(s, t, seq_len, micro_batch, capacity_factor) + working(t) for t in types)
    return int(max(loss_peak, inputs + recompute))
