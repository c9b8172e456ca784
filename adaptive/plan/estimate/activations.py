"""Activation memory of our decoder blocks, counted tensor by tensor, in bytes.

Korthikanti et al. (2022) give ~34·s·b·h bytes per layer for a GPT block. Our blocks differ (RMSNorm
in fp32, GQA, RoPE, SwiGLU, SDPA, an fp32 MoE router with capacity slots, MoD gather/scatter), so each
term below names the tensors autograd saves for them. The sums equal `saved_tensors_hooks` counts of
the real model classes (tests/fidelity), and `adaptive measure` re-measures them for any shape.

Notation, per token unless noted: h hidden, q = heads·head_dim, kv = kv_heads·head_dim, f SwiGLU
width, E experts, k experts per token, V vocabulary. 16-bit activations (2 bytes), fp32 where the
model computes in fp32.

`kernels`: "plain" counts transformers' Llama ops (the fp32 RMSNorm copies, four f-wide SwiGLU tensors,
the fp32 log-softmax over the vocabulary); "lean" counts adaptive/models/lean.py's blocks, which save
the RMSNorm input and 1/rms, SwiGLU's gate and up, and nothing vocabulary-wide (the loss runs in tiles
of `loss_chunk_tokens`). Both are counts of the real classes (tests/models/test_lean.py, tests/fidelity).

transformers' other decoder families (Qwen3, Gemma 2/3, Phi-3, Qwen3-MoE) and every LoRA/QLoRA fine-tune
(`finetune`) are counted op by op instead (hf_blocks.py): which weights train changes what each op keeps, which
the per-block formulas here do not follow. `counts_ops` says which count a spec gets.
"""

from __future__ import annotations

import math
from functools import lru_cache

from adaptive.plan.architecture.families import family_of
from adaptive.plan.architecture.presets import ModelSpec
from adaptive.plan.estimate.hf_blocks import (FINAL_NORM_BACKWARD, head_flow, layer_backward_moments, layer_flow,
                                              transformers_class)
from adaptive.plan.estimate.losses import LossImpl, loss_chunk_tokens, loss_impl
from adaptive.plan.finetune.method import Finetune

MIN_CAPACITY = 4  # DeepSpeed's and our MoE gate's default floor on expert capacity
KERNELS = ("lean", "plain")  # lean: adaptive/models/lean.py's blocks; plain: transformers' Llama-style ops


# Activation checkpointing (torchtitan's choices): "off"; "full" (every block keeps only its input);
# "every:N" (every N-th block, 0, N, 2N, ..., keeps only its input, the others keep everything, as
# transformers' `every_n_layers`); "mlp" (every block keeps its attention half and recomputes its MLP half
# from the half's input). "selective" in a request means: let the planner pick among SELECTIVE_POLICIES.
CHECKPOINTING = ("off", "selective", "full")
SELECTIVE_POLICIES = ("every:4", "every:2", "mlp")  # least recompute first, the OOM ladder's order


def parse_checkpoint_policy(policy: str) -> tuple[str, int]:
    """("off" | "full" | "every" | "mlp", N); ValueError on anything else."""
    if policy in ("off", "full", "mlp"):
        return policy, 1
    if policy.startswith("every:") and policy[6:].isdigit() and int(policy[6:]) >= 1:
        n = int(policy[6:])
        return ("full", 1) if n == 1 else ("every", n)
    raise ValueError(f"checkpointing policy must be off, full, mlp or every:N (N >= 1), got {policy!r}")


def norm_bytes(h: int, kernels: str = "lean") -> int:
    """An RMSNorm and its output (2h, kept by the projections that read it). Plain: fp32 copy 4h,
    1/rms 4, 16-bit cast 2h. Lean: its 16-bit input 2h and 1/rms 4."""
    return (8 if kernels == "plain" else 4) * h + 4


def swiglu_bytes(f: int, kernels: str = "lean") -> int:
    """SwiGLU of width f. Plain: gate, silu(gate), up, product (8f). Lean: gate and up (4f)."""
    return (8 if kernels == "plain" else 4) * f


def attention_half_bytes(s: ModelSpec, kernels: str = "lean") -> int:
    """Input RMSNorm (`norm_bytes`), post-RoPE q and k, v, the SDPA output (2 bytes each) and its fp32
    log-sum-exp per head."""
    q, kv = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    return norm_bytes(s.hidden_size, kernels) + 4 * q + 4 * kv + 4 * s.num_attention_heads


def dense_layer_bytes(s: ModelSpec, kernels: str = "lean") -> int:
    """Attention half + post-attention RMSNorm + SwiGLU."""
    return (attention_half_bytes(s, kernels) + norm_bytes(s.hidden_size, kernels)
            + swiglu_bytes(s.intermediate_size, kernels))


def expert_capacity(tokens: int, s: ModelSpec, capacity_factor: float) -> int:
    """Slots per expert: ceil(tokens / E · capacity_factor · k), at least MIN_CAPACITY."""
    e, k = s.num_local_experts, s.num_experts_per_tok
    return max(math.ceil(tokens / e * capacity_factor * k), MIN_CAPACITY)


def moe_layer_bytes(s: ModelSpec, tokens: int, capacity_factor: float, kernels: str = "lean") -> float:
    """Bytes of one MoE layer that `tokens` tokens enter (attention half included).

    Per token: the RMSNorm before the router (its output is gathered, not kept: `norm_bytes` less 2h);
    the router input in fp32 (4h); fp32 logits and softmax (8E) and a
    bool mask (E); routing indices, weights and masks (31k bytes for top-k); the combine's gathered
    expert outputs (2kh). Per capacity slot (E·C of them): the dispatched input (2h), the expert's
    SwiGLU (`swiglu_bytes`: lean keeps gate and up, 4f, in both implementations) and the slot's
    source index (8).
    Per layer: the fp32 copy of the router weight (4Eh).
    A Qwen2-MoE shared expert adds its SwiGLU over every token (8 bytes per unit of its width; measured
    slope 8.00 on transformers' class; its sigmoid gate's few bytes are within the router terms' error).
    """
    h, e, k, f = s.hidden_size, s.num_local_experts, s.num_experts_per_tok, s.moe_intermediate_size
    slots = e * expert_capacity(tokens, s, capacity_factor)
    per_token = (attention_half_bytes(s, kernels) + norm_bytes(h, kernels) - 2 * h + 4 * h + 9 * e + 4 + 31 * k
                 + 2 * k * h + 8 * s.shared_expert_intermediate_size)
    return tokens * per_token + slots * (2 * h + swiglu_bytes(f, kernels) + 8) + 4 * e * h + 4 * e + 8


def mod_selected(s: ModelSpec, seq_len: int) -> int:
    return math.ceil(s.mod_capacity * seq_len)


@lru_cache(maxsize=4096)  # a model's layers are mostly of one type: its sums ask for the same layer again and again
def layer_bytes(s: ModelSpec, layer_type: str, seq_len: int, micro_batch: int, capacity_factor: float,
                kernels: str = "lean") -> float:
    """Saved bytes of one layer for a micro-batch, without checkpointing."""
    tokens = seq_len * micro_batch
    if layer_type == "dense":
        return tokens * dense_layer_bytes(s, kernels)
    if layer_type == "moe":
        return moe_layer_bytes(s, tokens, capacity_factor, kernels)
    # MoD-routed: over all tokens, the router input (2h), 16-bit logit (2) and fp32 BCE terms (8);
    # over the selected tokens, the block (dense or MoE) plus gathered RoPE cos/sin (4·head_dim),
    # two index tensors and the router weight (18) and the weighted output delta (2h).
    selected = micro_batch * mod_selected(s, seq_len)
    routing = tokens * (2 * s.hidden_size + 10) + selected * (4 * s.head_dim + 18 + 2 * s.hidden_size)
    if layer_type == "mod":
        return routing + selected * dense_layer_bytes(s, kernels)
    return routing + moe_layer_bytes(s, selected, capacity_factor, kernels)


def loss_saved_bytes_per_token(s: ModelSpec, kernels: str = "lean", loss: str | None = None) -> int:
    """What the loss keeps for backward per token: plain, the fp32 log-softmax (4V); lean, nothing
    vocabulary-wide (its shifted targets are in `head_bytes`). Another `loss` (LOSSES): what it keeps and what the
    loop holds."""
    impl = loss_impl(loss)
    if impl is not None:
        return int((impl.saved + impl.held) * s.vocab_size)
    return 4 * s.vocab_size if kernels == "plain" else 0


def head_bytes(s: ModelSpec, seq_len: int, micro_batch: int, kernels: str = "lean",
               rope: bool = True, loss: str | None = None) -> int:
    """Outside the layers: token ids (8), final RMSNorm (`norm_bytes`; lean: its output is the
    chunked loss's input), the loss (`loss_saved_bytes_per_token`) and targets (8); RoPE cos/sin once
    per position (4·head_dim, shared by all layers; recomputed with each layer under checkpointing)."""
    tokens = seq_len * micro_batch
    per_token = norm_bytes(s.hidden_size, kernels) + loss_saved_bytes_per_token(s, kernels, loss) + 16
    return tokens * per_token + (4 * s.head_dim * seq_len if rope else 0)


def mlp_checkpointed_layer_bytes(s: ModelSpec, layer_type: str, seq_len: int, micro_batch: int,
                                 capacity_factor: float, kernels: str = "lean") -> float:
    """A layer under the "mlp" policy: its attention half, and the MLP half's input (2h) for the recompute;
    a routed layer adds its routing bytes over the selected tokens' block."""
    tokens = seq_len * micro_batch
    block = attention_half_bytes(s, kernels) + 2 * s.hidden_size
    if layer_type in ("dense", "moe"):
        return tokens * block
    selected = micro_batch * mod_selected(s, seq_len)
    routing = tokens * (2 * s.hidden_size + 10) + selected * (4 * s.head_dim + 18 + 2 * s.hidden_size)
    return routing + selected * block


def _policy(checkpointing: bool | str) -> tuple[str, int]:
    if isinstance(checkpointing, bool):
        return ("full", 1) if checkpointing else ("off", 1)
    return parse_checkpoint_policy(checkpointing)


def checkpointed_layers(s: ModelSpec, checkpointing: bool | str) -> tuple[bool, ...]:
    """Per layer: does it keep only its input (full / every:N)?"""
    kind, n = _policy(checkpointing)
    return tuple(kind == "full" or (kind == "every" and i % n == 0) for i in range(len(s.layer_types)))


# Families whose full-training count is the formulas above (kept as they are: the plain formula is exact for the
# dense ones; for the MoE ones it is our capacity-slot model, within 5% of transformers 5's dropless blocks)
FORMULA_FAMILIES = ("adaptive", "llama", "mistral", "qwen2", "mixtral", "qwen2_moe")


def counts_ops(s: ModelSpec, kernels: str, finetune: Finetune | None) -> bool:
    """Whether the op-by-op dataflow (hf_blocks.py) counts this spec: transformers' classes (plain kernels) the
    formulas above do not cover, and any LoRA/QLoRA fine-tune of them or of our dense plain blocks."""
    if kernels != "plain":
        return False
    adapted = finetune is not None and finetune.adapted
    if transformers_class(s):
        return adapted or s.model_type not in FORMULA_FAMILIES
    return adapted and set(s.layer_types) == {"dense"}  # our class's plain dense blocks are Llama's ops


@lru_cache(maxsize=4096)
def flow_activation_bytes(s: ModelSpec, seq_len: int, micro_batch: int, checkpointing: bool | str,
                          finetune: Finetune | None = None, attention: str = "sdpa", loss: str | None = None) -> int:
    """`activation_bytes` counted op by op (hf_blocks.py). A checkpointed layer keeps its input (2h a token; a
    fine-tune's checkpointing makes the embedding's output require grad, so every layer input does); the others
    keep their ops' tensors, given whether their input needs a gradient (a frozen embedding's output does not).
    transformers' classes build a KV cache in training only without checkpointing (`Flow.cache`)."""
    tokens = seq_len * micro_batch
    kind, _ = _policy(checkpointing)
    adapted = finetune is not None and finetune.adapted
    grad = not adapted or kind != "off"
    total, rope = 0.0, False
    for layer_type, ckpt in zip(s.layer_types, checkpointed_layers(s, checkpointing)):
        per_token, fixed, out_grad, reads_rope = layer_flow(s, layer_type, finetune, grad, kind != "mlp", attention,
                                                            seq_len if attention == "eager" else 0, kind == "off")
        if ckpt:
            total += tokens * 2 * s.hidden_size
        else:
            total += tokens * per_token + fixed
            rope = rope or reads_rope
        grad = out_grad
    per_token, per_sequence, fixed = head_flow(s, finetune, grad, loss)
    rope_tables = 4 * s.head_dim * seq_len if rope else 0  # cos and sin, 16-bit, shared by the batch and the layers
    return int(total + tokens * per_token + micro_batch * per_sequence + fixed + rope_tables)


@lru_cache(maxsize=4096)
def activation_bytes(s: ModelSpec, seq_len: int, micro_batch: int, checkpointing: bool | str,
                     capacity_factor: float = 1.0, kernels: str = "lean", finetune: Finetune | None = None,
                     loss: str | None = None) -> int:
    """Bytes autograd holds at the end of the forward pass (the loss's own included). `checkpointing`:
    False/True (off/full) or a policy ("off", "full", "every:N", "mlp"). `finetune`: None (pretraining) or a
    method; LoRA/QLoRA of transformers' classes is counted op by op (`flow_activation_bytes`), as are the families
    the formulas here do not cover; LoRA of our lean, MoE or MoD blocks is counted as full training (an upper
    bound: frozen weights keep less). `loss`: a stack's loss (LOSSES; None: what `kernels` implies)."""
    if counts_ops(s, kernels, finetune):
        return flow_activation_bytes(s, seq_len, micro_batch, checkpointing, finetune, loss=loss)
    tokens = seq_len * micro_batch
    kind, _ = _policy(checkpointing)
    if kind == "mlp":
        layers = sum(mlp_checkpointed_layer_bytes(s, t, seq_len, micro_batch, capacity_factor, kernels)
                     for t in s.layer_types)
        return int(layers + head_bytes(s, seq_len, micro_batch, kernels, loss=loss))
    if kind == "every":
        kept = checkpointed_layers(s, checkpointing)
        layers = sum(tokens * 2 * s.hidden_size if ckpt else
                     layer_bytes(s, t, seq_len, micro_batch, capacity_factor, kernels)
                     for t, ckpt in zip(s.layer_types, kept))
        return int(layers + head_bytes(s, seq_len, micro_batch, kernels, loss=loss))
    if kind == "full":
        # full checkpointing keeps each layer's input only; RoPE tables are recomputed with the layer
        layers = len(s.layer_types) * tokens * 2 * s.hidden_size
        return int(layers + head_bytes(s, seq_len, micro_batch, kernels, rope=False, loss=loss))
    layers = sum(layer_bytes(s, t, seq_len, micro_batch, capacity_factor, kernels) for t in s.layer_types)
    return int(layers + head_bytes(s, seq_len, micro_batch, kernels, loss=loss))


def head_saved_bytes(s: ModelSpec, seq_len: int, micro_batch: int, checkpointing: bool | str, kernels: str = "lean",
                     finetune: Finetune | None = None, loss: str | None = None) -> int:
    """The part of `activation_bytes` outside the decoder layers: the final norm, the output projection's and the
    loss's (what activation offloading leaves on the GPU, estimate/memory.py)."""
    if not counts_ops(s, kernels, finetune):
        kind, _ = _policy(checkpointing)
        return head_bytes(s, seq_len, micro_batch, kernels, rope=kind != "full", loss=loss)
    kind, _ = _policy(checkpointing)
    adapted = finetune is not None and finetune.adapted
    grad = not adapted or kind != "off"
    for layer_type in s.layer_types:  # does the last layer's output need a gradient (as flow_activation_bytes)
        grad = layer_flow(s, layer_type, finetune, grad, kind != "mlp", "sdpa", 0, kind == "off")[2]
    per_token, per_sequence, fixed = head_flow(s, finetune, grad, loss)
    return int(seq_len * micro_batch * per_token + micro_batch * per_sequence + fixed)


def eager_extra_bytes(s: ModelSpec, seq_len: int, micro_batch: int, checkpointing: bool | str,
                      kernels: str = "lean", finetune: Finetune | None = None) -> int:
    """What eager attention keeps beyond SDPA, all layers, one micro-batch. Where `activation_bytes` counts op by
    op, so is this (the eager count less the SDPA count): only the layers checkpointing keeps, Gemma 2's soft cap
    (2 bytes a score), and a fine-tune's frozen weights (a frozen o_proj keeps no copy of its input; a layer whose
    q, k and v need no gradient keeps no scores). Elsewhere attention.py's 6 bytes a score, on the share of layers
    checkpointing keeps (as estimate/memory.py has always counted it)."""
    if counts_ops(s, kernels, finetune):
        return (flow_activation_bytes(s, seq_len, micro_batch, checkpointing, finetune, "eager")
                - flow_activation_bytes(s, seq_len, micro_batch, checkpointing, finetune))
    from adaptive.plan.estimate.attention import eager_extra_saved_bytes

    kind, n = _policy(checkpointing)
    kept = 0.0 if kind == "full" else 1 - 1 / n if kind == "every" else 1.0
    return int(kept * eager_extra_saved_bytes(s, seq_len, micro_batch))


def eager_backward_extra_bytes(s: ModelSpec, seq_len: int, micro_batch: int, checkpointing: bool | str,
                               kernels: str = "lean", finetune: Finetune | None = None) -> int:
    """What eager attention adds to `backward_peak_bytes` beyond what it keeps (`eager_extra_bytes`): a recomputed
    layer's scores and their gradients, the causal mask checkpointing holds. Where `activation_bytes` counts op
    by op, the eager backward peak less the SDPA one less the kept extra (it can be below zero: the kept scores of
    the layers above are freed by the time a layer's recompute peaks); elsewhere attention.py's figure for a
    recomputed layer, when checkpointing drops any layer (as estimate/memory.py has always counted it)."""
    if counts_ops(s, kernels, finetune):
        return (flow_backward_peak_bytes(s, seq_len, micro_batch, checkpointing, finetune, "eager")
                - flow_backward_peak_bytes(s, seq_len, micro_batch, checkpointing, finetune)
                - eager_extra_bytes(s, seq_len, micro_batch, checkpointing, kernels, finetune))
    from adaptive.plan.estimate.attention import eager_recompute_bytes

    kind, _ = _policy(checkpointing)
    return eager_recompute_bytes(s, seq_len, micro_batch) if kind in ("full", "every") else 0


def loss_working_bytes(s: ModelSpec, tokens: int, kernels: str = "lean") -> int:
    """The loss's backward working set on top of what is saved.

    Plain (measured, tests/fidelity): the fp32 gradient of the logits and its 16-bit cast, 8 bytes per
    logit, while the log-softmax is still held. Lean (lean.ChunkedLMLossFunction): one tile of
    `loss_chunk_tokens` tokens at a time, its recomputed logits in fp32 and their softmax (8 bytes per
    logit of the tile), plus the 16-bit gradients of the head's input (2h per token) and of its weight
    (2Vh), which the plain path makes too but alongside far larger logit gradients.
    """
    v, h = s.vocab_size, s.hidden_size
    if kernels == "plain":
        return tokens * 8 * v
    tile = min(tokens, loss_chunk_tokens(v))
    return 8 * tile * v + 2 * tokens * h + 2 * v * h


def loss_backward_bytes(s: ModelSpec, seq_len: int, micro_batch: int, impl: LossImpl, head_trains: bool) -> int:
    """A non-default loss's backward working set on top of what is saved: its own bytes over one chunk of tokens
    (`LossImpl.working`), the hidden states' 16-bit gradient the chunks fill (2h a token), and, where the head
    trains, its weight's 16-bit gradient (2Vh), which the output projection's backward makes at the first chunk."""
    v, h = s.vocab_size, s.hidden_size
    tokens = seq_len * micro_batch
    head = 2 * v * h if head_trains else 0
    return int(impl.working * v * impl.chunk_tokens(seq_len, micro_batch) + 2 * h * tokens + head)


def moe_backward_bytes(s: ModelSpec, tokens: int, capacity_factor: float, kernels: str = "lean") -> float:
    """Working set of one MoE layer's backward, fitted to measurements of random shapes: gradients of
    the gathered tokens (2.8h per token) and of the dispatched capacity slots (5.6h per slot). 16-bit lean
    experts hold their [slots, 2I] gradient and the product (then grad_product in its place) beside the saved
    gate and up (silu is rebuilt inside the gradient's up half): 1.5f more per slot (fitted: debug_200m MoE and
    hybrid, seq 2048, micro-batch 8, where the backward sets the peak; 3.2f and 0.2f alone. 5f before the
    rebuild moved into the gradient)."""
    slots = s.num_local_experts * expert_capacity(tokens, s, capacity_factor)
    lean = 1.5 * s.moe_intermediate_size if kernels == "lean" else 0
    return 2.8 * tokens * s.hidden_size + (5.6 * s.hidden_size + lean) * slots


@lru_cache(maxsize=4096)
def flow_backward_peak_bytes(s: ModelSpec, seq_len: int, micro_batch: int, checkpointing: bool | str,
                             finetune: Finetune | None = None, attention: str = "sdpa", loss: str | None = None) -> int:
    """`backward_peak_bytes` where `activation_bytes` counts op by op. The moments: the loss's backward (its fp32
    logit gradient and 16-bit cast, 8 bytes a logit, beside everything saved); the final norm's (the loss's and the
    head's own freed); then each layer from the top, the layers above freed, those below still saved, the layer's
    own saved (recomputed from its kept input if checkpointed) at its backward's peaks (`layer_backward_moments`).
    Under checkpointing the RoPE tables stay held (the checkpointed layers read them again). QLoRA's dequantized
    16-bit weight (each backward matmul through a 4-bit base builds one) is not here: estimate/memory.py adds it as
    its own part (finetune/roles.py `dequantized_bytes`)."""
    tokens = seq_len * micro_batch
    kind, _ = _policy(checkpointing)
    adapted = finetune is not None and finetune.adapted
    h = s.hidden_size
    keys = seq_len if attention == "eager" else 0  # eager attention: the scores' bytes per token
    saved = flow_activation_bytes(s, seq_len, micro_batch, checkpointing, finetune, attention, loss)
    impl = loss_impl(loss)
    peak = saved + (loss_working_bytes(s, tokens, "plain") if impl is None
                    else loss_backward_bytes(s, seq_len, micro_batch, impl, not adapted))
    grads, grad = [], not adapted or kind != "off"  # which layer inputs need a gradient, as in the forward
    for t in s.layer_types:
        grads.append(grad)
        grad = layer_flow(s, t, finetune, grad, kind != "mlp", attention, keys, kind == "off")[2]
    per_token, per_sequence, fixed = head_flow(s, finetune, grad, loss)
    ids = 0 if adapted else 8  # the embedding's backward (a trained embedding) still needs the token ids
    # freed by the final norm's fp32 backward: the loss's own, and, trained, the head's input and the norm's copy
    # its weight's gradient read (16-bit cast; Gemma: the fp32 normalised x)
    trained = 0 if adapted else 2 * h + (4 if family_of(s).norm == "gemma" else 2) * h
    per_logit = 4 * s.vocab_size if impl is None else impl.saved * s.vocab_size
    loss_own = tokens * (per_logit + 8 + trained) + micro_batch * per_sequence
    loop = 0 if impl is None else tokens * impl.held * s.vocab_size  # logits the loop holds until backward ends
    rope = 4 * s.head_dim * seq_len if kind == "full" else 0  # held for the checkpointed layers, not saved by them
    if attention == "eager" and kind != "off":
        rope += 2 * micro_batch * seq_len * seq_len  # eager's 16-bit causal mask, held for the recompute too
    peak = max(peak, saved + rope - loss_own + tokens * FINAL_NORM_BACKWARD * h)  # the final norm's backward
    held = saved + rope - tokens * (per_token - ids) - micro_batch * per_sequence - fixed  # the layers' own
    kept = checkpointed_layers(s, checkpointing)
    for i in reversed(range(len(s.layer_types))):
        t, ckpt = s.layer_types[i], kept[i]
        own = tokens * 2 * h
        if not ckpt:
            per_token, fixed, _, _ = layer_flow(s, t, finetune, grads[i], kind != "mlp", attention, keys, kind == "off")
            own = tokens * per_token + fixed
        below = held - own
        # a checkpointed layer is recomputed without a cache, its input needing a gradient
        moments = layer_backward_moments(s, t, finetune, grads[i] or ckpt, kind == "off" and not ckpt, attention,
                                         keys)
        peak = max(peak, below + loop + (tokens * 2 * h if ckpt else 0) + max(tokens * p + f for p, f in moments))
        held = below
    return int(peak)


@lru_cache(maxsize=4096)
def backward_peak_bytes(s: ModelSpec, seq_len: int, micro_batch: int, checkpointing: bool | str,
                        capacity_factor: float = 1.0, kernels: str = "lean", finetune: Finetune | None = None,
                        loss: str | None = None) -> int:
    """Activation-side bytes at the peak of backward: saved tensors plus the working set.

    Measured (tests/fidelity): the loss's backward adds `loss_working_bytes` while the rest is still
    saved. An MoE layer's backward can exceed that (`moe_backward_bytes`); by then the plain loss's
    log-softmax is freed but 6.5 bytes per logit of its backward remain (lean: the 2h-per-token gradient
    of the hidden states). With checkpointing a layer's recomputed activations and their gradients come on
    top of the kept layer inputs (dense: its saved bytes + 8h + 2.5f per token). Under "every:N" that
    recompute happens at the topmost checkpointed layer, with the layers above it already freed; under
    "mlp" each layer recomputes its MLP half (dense: its norm and SwiGLU bytes + 8h + 2.5f per token).
    `finetune` as in `activation_bytes` (`flow_backward_peak_bytes` where that counts op by op). Another `loss`
    (LOSSES): its own backward (`loss_backward_bytes`), and below it what the loop still holds and the hidden
    states' gradient.
    """
    if counts_ops(s, kernels, finetune):
        return flow_backward_peak_bytes(s, seq_len, micro_batch, checkpointing, finetune, loss=loss)
    tokens = seq_len * micro_batch
    saved = activation_bytes(s, seq_len, micro_batch, checkpointing, capacity_factor, kernels, loss=loss)
    impl = loss_impl(loss)
    adapted = finetune is not None and finetune.adapted
    loss_peak = saved + (loss_working_bytes(s, tokens, kernels) if impl is None
                         else loss_backward_bytes(s, seq_len, micro_batch, impl, not adapted))
    selected = micro_batch * mod_selected(s, seq_len)

    kind, _ = _policy(checkpointing)

    def working(layer_type: str, recomputed: bool = kind == "full") -> float:
        if layer_type == "moe":
            return moe_backward_bytes(s, tokens, capacity_factor, kernels)
        if layer_type == "hybrid":
            return moe_backward_bytes(s, selected, capacity_factor, kernels)
        f, h = s.intermediate_size, s.hidden_size
        n = tokens if layer_type == "dense" else selected
        if recomputed:  # measured: plain 8h + 2.5f, lean 10f + h per token (its SwiGLU rebuilt twice)
            return n * (8 * h + 2.5 * f if kernels == "plain" else 10 * f + h)
        # lean SwiGLU's backward rebuilds silu(gate) and the product beside their gradients (measured
        # 10f + 2h per token on debug_200m); plain's layer backward stays under its loss's 6.5 bytes/logit
        return n * (10 * f + 2 * h) if kernels == "lean" else 0.0

    types = set(s.layer_types)
    left = tokens * (6.5 * s.vocab_size if kernels == "plain" else 2 * s.hidden_size)
    if impl is not None:
        left = tokens * (impl.held * s.vocab_size + 2 * s.hidden_size)
    if kind == "off":
        layer_peak = saved + left + max(working(t) for t in types)
        return int(max(loss_peak, layer_peak))
    if kind == "mlp":
        def half(t: str) -> float:  # the recomputed MLP half (dense: norm + SwiGLU) and its working set
            n = tokens if t in ("dense", "moe") else selected
            if t in ("dense", "mod"):
                return (n * (norm_bytes(s.hidden_size, kernels) + swiglu_bytes(s.intermediate_size, kernels))
                        + working(t, True))
            full = layer_bytes(s, t, seq_len, micro_batch, capacity_factor, kernels)
            return full - mlp_checkpointed_layer_bytes(s, t, seq_len, micro_batch, capacity_factor, kernels) + \
                moe_backward_bytes(s, n, capacity_factor, kernels)
        # measured (debug MoE and hybrid, plain kernels): the plain loss's 6.5 bytes per logit are gone by the
        # time the top MoE half recomputes; what flows down is the 2h-per-token gradient, as with lean
        return int(max(loss_peak, saved + tokens * 2 * s.hidden_size + max(half(t) for t in types)))
    if kind == "every":
        kept = checkpointed_layers(s, checkpointing)
        peak = saved + left + max((working(t, False) for t, ckpt in zip(s.layer_types, kept) if not ckpt),
                                  default=0.0)
        above = 0.0  # saved bytes of the layers above, freed by the time a layer's backward runs
        for i in reversed(range(len(s.layer_types))):
            t = s.layer_types[i]
            if kept[i]:
                recompute = layer_bytes(s, t, seq_len, micro_batch, capacity_factor, kernels) + working(t, True)
                peak = max(peak, saved - above + recompute)
                above += tokens * 2 * s.hidden_size
            else:
                above += layer_bytes(s, t, seq_len, micro_batch, capacity_factor, kernels)
        return int(max(loss_peak, peak))
    inputs = len(s.layer_types) * tokens * 2 * s.hidden_size + tokens * (norm_bytes(s.hidden_size, kernels) + 16)
    if impl is not None:
        inputs += tokens * impl.held * s.vocab_size  # logits the loop holds through backward
    recompute = max(layer_bytes(s, t, seq_len, micro_batch, capacity_factor, kernels) + working(t) for t in types)
    return int(max(loss_peak, inputs + recompute))
