"""Activation memory of our decoder blocks: what autograd saves for backward, per token, in bytes.

Korthikanti et al. (2022) give ~34·s·b·h bytes per layer for a GPT block with 16-bit activations.
Our blocks differ (RMSNorm, GQA, RoPE, SwiGLU, SDPA, fp32 router math, MoE dispatch, MoD
gather/scatter), so each term below is counted from the tensors our modeling code saves, and
tests/plan/test_activations_measured.py checks the sums against `saved_tensors_hooks` counts.
"""

from __future__ import annotations

from functools import lru_cache

from adaptive.plan.presets import ModelSpec

ACT = 2  # bytes per 16-bit activation element
F32 = 4


def attention_block_bytes_per_token(s: ModelSpec) -> float:
    """Attention half of a block: norm, q/k/v/o projections, RoPE, SDPA."""
    h, q, kv = s.hidden_size, s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    norm = h * ACT + F32  # RMSNorm input + its fp32 reciprocal RMS per token
    proj_in = h * ACT  # normalised input, shared by q/k/v projections
    sdpa = (q + 2 * kv) * ACT + q * ACT + s.num_attention_heads * F32  # q,k,v, output, logsumexp
    return norm + proj_in + sdpa


def mlp_bytes_per_token(hidden: int, inner: int) -> float:
    """SwiGLU: gate and up outputs, silu(gate), and their product feeding down_proj."""
    norm = hidden * ACT + F32 + hidden * ACT  # RMSNorm input, rstd, normalised output
    return norm + 4 * inner * ACT


def moe_bytes_per_token(s: ModelSpec, capacity_factor: float) -> float:
    """Router in fp32 plus top-k experts' SwiGLU on capacity slots (k·cf slots per token)."""
    h, e = s.hidden_size, s.num_local_experts
    norm = h * ACT + F32 + h * ACT
    router = e * F32 * 2  # fp32 logits and softmax probabilities
    slots = s.num_experts_per_tok * capacity_factor
    experts = slots * (h * ACT + 4 * s.moe_intermediate_size * ACT + h * ACT)  # in, swiglu, out
    return norm + router + experts


@lru_cache(maxsize=1024)
def layer_bytes_per_token(s: ModelSpec, layer_type: str, capacity_factor: float) -> float:
    """Saved bytes per *input* token of one layer without checkpointing."""
    if layer_type in ("moe", "hybrid"):
        mlp = moe_bytes_per_token(s, capacity_factor)
    else:
        mlp = mlp_bytes_per_token(s.hidden_size, s.intermediate_size)
    block = attention_block_bytes_per_token(s) + mlp
    if layer_type in ("mod", "hybrid"):
        # router input (full sequence) + the gathered tokens' block + the weighted delta
        return s.hidden_size * ACT + F32 + s.mod_capacity * (block + s.hidden_size * ACT)
    return block


def activation_bytes(s: ModelSpec, seq_len: int, micro_batch: int, checkpointing: bool,
                     capacity_factor: float = 1.0, ep_size: int = 1) -> int:
    """Bytes autograd holds across all layers at the end of the forward pass."""
    tokens = seq_len * micro_batch
    if checkpointing:
        # full checkpointing keeps each layer's input only
        return int(len(s.layer_types) * tokens * s.hidden_size * ACT)
    del ep_size  # all-to-all moves slots between GPUs; each GPU still holds its tokens' slots
    return int(model_bytes_per_token(s, capacity_factor) * tokens)


@lru_cache(maxsize=1024)
def model_bytes_per_token(s: ModelSpec, capacity_factor: float) -> float:
    return sum(layer_bytes_per_token(s, t, capacity_factor) for t in s.layer_types)


def logits_bytes(s: ModelSpec, seq_len: int, micro_batch: int) -> int:
    """16-bit logits, their fp32 upcast and the loss's saved log-softmax, at the start of backward."""
    tokens = seq_len * micro_batch
    return int(tokens * s.vocab_size * (ACT + F32 + F32) + tokens * s.hidden_size * ACT)


def transient_bytes(s: ModelSpec, seq_len: int, micro_batch: int, checkpointing: bool,
                    capacity_factor: float = 1.0) -> int:
    """Working memory on top of saved tensors while one layer runs backward.

    Gradients of that layer's activations are about as large as its saved tensors; with
    checkpointing the layer's forward is recomputed first, so its activations are live too.
    The fp32 gradient of the logits also exists while the LM head runs backward.
    """
    tokens = seq_len * micro_batch
    worst_layer = max(layer_bytes_per_token(s, t, capacity_factor) for t in set(s.layer_types))
    layer = worst_layer * tokens
    logits_grad = tokens * s.vocab_size * F32
    return int(max(logits_grad, layer * (2 if checkpointing else 1)))
