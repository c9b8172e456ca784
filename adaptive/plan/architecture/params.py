"""Analytic parameter counts. They must equal `sum(p.numel())` of the real model (tests/models)."""

from __future__ import annotations

from functools import lru_cache

from adaptive.plan.architecture.blocks import block_type
from adaptive.plan.architecture.families import family_of
from adaptive.plan.architecture.presets import ModelSpec
from adaptive.record import record


@record
class ParamCounts:
    """Parameter counts of one model."""

    total: int
    active: int  # per token: non-expert params + top-k experts (+ shared expert)
    expert: int  # params inside routed experts (split by ep_size)
    embedding: int  # input embedding + untied LM head
    largest_layer: int  # largest single module, as DeepSpeed's ZeRO-3 estimator counts it
    per_layer: tuple[int, ...]  # total params of each decoder layer


def attention_params(s: ModelSpec) -> int:
    q = s.hidden_size * s.num_attention_heads * s.head_dim
    kv = 2 * s.hidden_size * s.num_key_value_heads * s.head_dim
    o = s.num_attention_heads * s.head_dim * s.hidden_size
    bias = (s.num_attention_heads + 2 * s.num_key_value_heads) * s.head_dim if s.qkv_bias else 0
    o_bias = s.hidden_size if s.o_bias else 0
    qk_norm = 2 * s.head_dim if family_of(s).qk_norm else 0  # Qwen3, Gemma 3: an RMSNorm over head_dim on q and k
    return q + kv + o + bias + o_bias + qk_norm


def swiglu_params(hidden: int, inner: int, bias: bool = False) -> int:
    # gate_proj, up_proj: hidden -> inner; down_proj: inner -> hidden
    return 3 * hidden * inner + ((2 * inner + hidden) if bias else 0)


def expert_params(s: ModelSpec) -> int:
    return swiglu_params(s.hidden_size, s.moe_intermediate_size, s.mlp_bias)


def router_params(s: ModelSpec) -> int:
    return s.hidden_size * s.num_local_experts  # gate: Linear(hidden, E, bias=False)


def shared_expert_params(s: ModelSpec) -> int:
    if not s.shared_expert_intermediate_size:
        return 0
    # Qwen2-MoE: a SwiGLU shared expert plus a Linear(hidden, 1) gate on it
    return swiglu_params(s.hidden_size, s.shared_expert_intermediate_size) + s.hidden_size


def mod_router_params(s: ModelSpec) -> int:
    router = s.hidden_size  # Linear(hidden, 1, bias=False): one scalar per token
    p = s.mod_predictor_hidden_size
    predictor = (s.hidden_size * p + p) if p else 0  # Linear(h, p) -> SiLU -> Linear(p, 1), no biases
    return router + predictor


@lru_cache(maxsize=1024)
def layer_params(s: ModelSpec, layer_type: str) -> tuple[int, int, int]:
    """(total, active, expert) params of one decoder layer of `layer_type`."""
    norms = family_of(s).norms_per_layer * s.hidden_size  # Gemma: 4, around both halves
    base = attention_params(s) + norms
    kind = block_type(layer_type)
    if kind.routed:
        base += mod_router_params(s)
    if kind.has_experts:
        experts = s.num_local_experts * expert_params(s)
        shared = router_params(s) + shared_expert_params(s)
        active = base + shared + s.num_experts_per_tok * expert_params(s)
        return base + shared + experts, active, experts
    mlp = swiglu_params(s.hidden_size, s.intermediate_size, s.mlp_bias)
    return base + mlp, base + mlp, 0


@lru_cache(maxsize=256)
def count_params(s: ModelSpec) -> ParamCounts:
    per_layer = [layer_params(s, t) for t in s.layer_types]
    embed = s.vocab_size * s.hidden_size
    head = 0 if s.tie_word_embeddings else embed
    final_norm = s.hidden_size
    total = sum(t for t, _, _ in per_layer) + embed + head + final_norm
    active = sum(a for _, a, _ in per_layer) + embed + head + final_norm
    expert = sum(e for _, _, e in per_layer)
    return ParamCounts(
        total=total,
        active=active,
        expert=expert,
        embedding=embed + head,
        largest_layer=largest_module_params(s),
        per_layer=tuple(t for t, _, _ in per_layer),
    )


def largest_module_params(s: ModelSpec) -> int:
    """The biggest module's own parameters: what ZeRO-3 gathers at once (DeepSpeed's estimator)."""
    h = s.hidden_size
    candidates = [s.vocab_size * h, h * s.num_attention_heads * s.head_dim, h * s.intermediate_size]
    if s.is_moe:
        candidates.append(h * s.moe_intermediate_size)
    return max(candidates)
