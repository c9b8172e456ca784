"""Extra activation memory of eager attention (`adaptive fit --attention eager`), in bytes.

SDPA/flash attention keeps q, k, v, its output and an fp32 log-sum-exp per head: nothing quadratic in
the sequence (activations.py). Eager attention (transformers' `eager_attention_forward`, ours alike:
`softmax(q·kᵀ·scale + mask, dtype=float32).to(dtype)`, then `probs @ v`) keeps the score-sized
tensors. Korthikanti et al. 2022 (arXiv 2205.05198, eq. 1) count 5·a·s²·b per layer for 16-bit
scores: softmax output 2, dropout output 2, dropout mask 1. Ours differs, and was counted on our
classes (tests/fidelity/test_eager_attention.py):

- softmax computed in fp32 keeps its fp32 output for its backward: 4 bytes per score;
- the 16-bit probabilities the value matmul keeps: 2 bytes per score;
- dropout at p=0 returns its input and keeps no mask;
- GQA: eager repeats k and v to every query head (`repeat_kv`) and the matmuls keep the repeated
  copies, 2·(q_width − kv_width) bytes per token more for each of k and v, where SDPA keeps k and v
  once; eager keeps no log-sum-exp (4 bytes per head per token less).

So 6·a·s per token per layer, i.e. Korthikanti's 5·a·s/h per s·b·h with 6 in place of 5 (counted
exactly on our class, dense and MoD, MHA and GQA). Without checkpointing the backward adds nothing
score-sized beyond that (each layer's gradients of its scores fit in what its freed tensors leave;
measured). With full checkpointing nothing score-sized is kept, but the recomputed layer holds its
scores again plus their gradients (16-bit grad of the probabilities, the fp32 softmax gradient):
measured 9.9 to 11.0 bytes per score above SDPA's backward peak; EAGER_RECOMPUTE_BYTES_PER_SCORE
takes the upper figure.
"""

from __future__ import annotations

import math

from adaptive.plan.architecture.presets import ModelSpec

ATTENTIONS = ("sdpa", "eager")
EAGER_SAVED_BYTES_PER_SCORE = 6  # fp32 softmax output (4) + 16-bit probabilities (2)
EAGER_RECOMPUTE_BYTES_PER_SCORE = 11  # checkpointing: one recomputed layer's scores + their gradients


def attended(spec: ModelSpec, layer_type: str, seq_len: int) -> tuple[int, int]:
    """(queries per sequence, keys per sequence) of one layer: MoD-routed layers attend over their
    ceil(capacity·s) selected tokens only."""
    if layer_type in ("mod", "hybrid"):
        k = math.ceil(spec.mod_capacity * seq_len)
        return k, k
    return seq_len, seq_len


def eager_extra_saved_bytes(spec: ModelSpec, seq_len: int, micro_batch: int) -> int:
    """Bytes eager attention keeps beyond SDPA, all layers, for one micro-batch."""
    a = spec.num_attention_heads
    q_width, kv_width = a * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    total = 0
    for t in spec.layer_types:
        queries, keys = attended(spec, t, seq_len)
        tokens = queries * micro_batch
        scores = micro_batch * a * queries * keys
        repeat = 4 * (q_width - kv_width) if q_width != kv_width else 0
        total += EAGER_SAVED_BYTES_PER_SCORE * scores + tokens * (repeat - 4 * a)
    return int(total)


def eager_recompute_bytes(spec: ModelSpec, seq_len: int, micro_batch: int) -> int:
    """Under full checkpointing: the largest layer's score-sized backward working set."""
    a = spec.num_attention_heads
    worst = max(micro_batch * a * q * k for q, k in (attended(spec, t, seq_len) for t in set(spec.layer_types)))
    return int(EAGER_RECOMPUTE_BYTES_PER_SCORE * worst)


__all__ = ["ATTENTIONS", "eager_extra_saved_bytes", "eager_recompute_bytes"]
