"""Model presets: the one source of truth for every shape that `adaptive` plans, builds and trains.

A preset is a Llama-style decoder shape (RMSNorm, RoPE, GQA, SwiGLU). An architecture turns it into
a `ModelSpec` with a per-layer pattern (`layer_types`), which the planner counts and the model
classes build (`AdaptiveConfig.from_preset` reads the same `ModelSpec`).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, fields
from functools import cached_property

from adaptive.errors import AdaptiveError, unknown
from adaptive.plan.architecture.blocks import BLOCK_TYPES, block_type
from adaptive.record import record

ARCHS = ("dense", "moe", "mod", "hybrid")
LAYER_TYPES = tuple(BLOCK_TYPES)  # the registry in blocks.py


@record
class Shape:
    """A dense Llama-style decoder shape. Field names follow transformers' LlamaConfig."""

    name: str
    nominal_params: float  # the size the name promises, e.g. 7e9 for b7
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


# Dense shapes. Each dense count is within 10% of `nominal_params` (tests/plan/architecture/test_presets.py).
# b7 is Mistral-7B's shape, b70 Llama-2-70B's; the others are scaled in the same family.
PRESETS: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("debug", 0.5e6, vocab_size=2048, hidden_size=64, intermediate_size=192,
              num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=2048),
        Shape("debug_200m", 200e6, vocab_size=32000, hidden_size=1024, intermediate_size=2816,
              num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=8),
        Shape("b1", 1e9, vocab_size=32000, hidden_size=2048, intermediate_size=5632,
              num_hidden_layers=20, num_attention_heads=32, num_key_value_heads=8),
        Shape("b7", 7e9, vocab_size=32000, hidden_size=4096, intermediate_size=14336,
              num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
        Shape("b14", 14e9, vocab_size=32000, hidden_size=5120, intermediate_size=13824,
              num_hidden_layers=50, num_attention_heads=40, num_key_value_heads=8),
        Shape("b30", 30e9, vocab_size=32000, hidden_size=6656, intermediate_size=17920,
              num_hidden_layers=64, num_attention_heads=52, num_key_value_heads=4),
        Shape("b70", 70e9, vocab_size=32000, hidden_size=8192, intermediate_size=28672,
              num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
    )
}

# Architecture defaults (docs/BENCHMARKS.md, "Claims we compared against"): MoE = 8 experts, top-2, every layer;
# MoD = every other block routed (the first block never is), capacity 0.5 as in those claims
# (Raposo et al. report 0.125 as their best).
DEFAULT_NUM_EXPERTS = 8
DEFAULT_TOP_K = 2
DEFAULT_MOE_LAYER_FREQ = 1
DEFAULT_MOD_CAPACITY = 0.5
DEFAULT_MOD_LAYER_FREQ = 2


@record
class ModelSpec:
    """Everything needed to count, plan and build one model. Field names follow transformers."""

    name: str
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 puts biases on q/k/v only
    o_bias: bool = False
    mlp_bias: bool = False
    # MoE
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on shared expert (+ its 1-unit gate)
    # MoD
    mod_capacity: float = 1.0
    mod_predictor_hidden_size: int = 0  # 0: route causally with the router's own logits (BCE-trained)
    # Gemma 2: tanh soft caps on the attention scores and on the logits (x -> cap * tanh(x / cap))
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Where the shape came from: "preset" or "hf:<model_type>"
    source: str = "preset"
    nominal_params: float | None = None

    def __hash__(self) -> int:
        """The dataclass's hash (of the fields' tuple, layer_types and all), computed once: the planner's caches
        hash the spec of every candidate several times."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash(tuple(getattr(self, f.name) for f in fields(self)))
        return h

    def __getstate__(self) -> dict:
        # a string's hash differs between processes: a pickled spec computes its own
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @cached_property  # the planner asks thousands of times per fit
    def is_moe(self) -> bool:
        return any(block_type(t).has_experts for t in self.layer_types)

    @cached_property  # the planner asks thousands of times per fit
    def is_mod(self) -> bool:
        return any(block_type(t).routed for t in self.layer_types)

    @cached_property  # the planner asks thousands of times per fit
    def num_moe_layers(self) -> int:
        return sum(block_type(t).has_experts for t in self.layer_types)

    @cached_property  # the planner asks thousands of times per fit
    def num_mod_layers(self) -> int:
        return sum(block_type(t).routed for t in self.layer_types)

    @property
    def model_type(self) -> str:
        """The config.json's model_type ("adaptive" for presets and our exports): its family (families.py)."""
        return self.source[3:] if self.source.startswith("hf:") else "adaptive"

    def mod_tokens(self, seq_len: int) -> int:
        """Tokens a routed block processes per sequence: exactly ceil(capacity * seq)."""
        return min(seq_len, math.ceil(self.mod_capacity * seq_len))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d


def layer_pattern(arch: str, num_layers: int, moe_layer_freq: int = DEFAULT_MOE_LAYER_FREQ,
                  mod_layer_freq: int = DEFAULT_MOD_LAYER_FREQ) -> tuple[str, ...]:
    """Per-layer types for an architecture. Routed layers are the last of each group of `freq`."""
    if arch not in ARCHS:
        raise unknown("arch", arch, ARCHS)
    types = []
    for i in range(num_layers):
        moe = block_type(arch).has_experts and i % moe_layer_freq == moe_layer_freq - 1
        mod = block_type(arch).routed and i % mod_layer_freq == mod_layer_freq - 1
        types.append("hybrid" if moe and mod else "moe" if moe else "mod" if mod else "dense")
    return tuple(types)


def spec_from_shape(shape: Shape, arch: str = "dense", *, num_experts: int = DEFAULT_NUM_EXPERTS,
                    top_k: int = DEFAULT_TOP_K, moe_layer_freq: int = DEFAULT_MOE_LAYER_FREQ,
                    mod_capacity: float = DEFAULT_MOD_CAPACITY,
                    mod_layer_freq: int = DEFAULT_MOD_LAYER_FREQ) -> ModelSpec:
    """A dense shape turned into `arch`. Experts are Mixtral-style: each as wide as the dense FFN."""
    validate_arch_knobs(num_experts, top_k, mod_capacity, moe_layer_freq, mod_layer_freq)
    moe, mod = block_type(arch).has_experts, block_type(arch).routed
    return ModelSpec(
        name=shape.name,
        arch=arch,
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        layer_types=layer_pattern(arch, shape.num_hidden_layers, moe_layer_freq, mod_layer_freq),
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=shape.tie_word_embeddings,
        num_local_experts=num_experts if moe else 0,
        num_experts_per_tok=top_k if moe else 0,
        moe_intermediate_size=shape.intermediate_size if moe else 0,
        mod_capacity=mod_capacity if mod else 1.0,
        nominal_params=shape.nominal_params,
    )


def validate_arch_knobs(num_experts: int, top_k: int, mod_capacity: float, moe_layer_freq: int,
                        mod_layer_freq: int) -> None:
    if num_experts < 1:
        raise AdaptiveError(f"num_experts must be at least 1, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise AdaptiveError(f"top_k ({top_k}) must be between 1 and num_experts ({num_experts})")
    if top_k > 2:
        raise AdaptiveError(f"top_k ({top_k}) must be 1 or 2: DeepSpeed's MoE gate supports only those")
    if not 0.0 < mod_capacity <= 1.0:
        raise AdaptiveError(f"mod_capacity must be in (0, 1], got {mod_capacity}")
    for name, freq in (("moe_layer_freq", moe_layer_freq), ("mod_layer_freq", mod_layer_freq)):
        if freq < 1:
            raise AdaptiveError(f"{name} must be at least 1, got {freq}")


def preset_spec(name: str, arch: str = "dense", **arch_knobs) -> ModelSpec:
    """The preset `name` built as `arch`. Raises AdaptiveError for unknown names."""
    if name not in PRESETS:
        if re.fullmatch(r"s\d+(\.\d+)?[mb]", name):  # the size ladder's names (ladder.params_name): a budget's winner
            raise AdaptiveError(f"unknown model {name!r}: a size-ladder shape that a budget search picks, not a preset; "
                                "`adaptive fit --budget-usd ... --out DIR` writes the winner's DIR/config.json, which "
                                f"--model DIR takes (presets: {', '.join(PRESETS)})")
        raise unknown("model", name, PRESETS)
    if arch not in ARCHS:
        raise unknown("arch", arch, ARCHS)
    return spec_from_shape(PRESETS[name], arch, **arch_knobs)


__all__ = [
    "ARCHS", "LAYER_TYPES", "PRESETS", "Shape", "ModelSpec", "layer_pattern", "preset_spec",
    "spec_from_shape", "validate_arch_knobs",
]
