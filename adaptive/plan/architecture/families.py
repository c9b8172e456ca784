"""transformers' decoder families: what each `model_type`'s class is built of in transformers 5.

A config.json gives a model's sizes; the family gives what its class always builds around them: the linear
layers of its attention and MLP and their names (what PEFT's LoRA targets and bitsandbytes quantizes), per-head
q/k norms, the norms around each half, the activation, how experts are stored. One row per `model_type`, read
from the installed transformers' modeling files; tests/plan/architecture/test_families.py builds every family on
the meta device and checks the modules, their shapes and the defaults below against it.

"adaptive" is our own classes (presets and our exports): Llama-style, with names that match Llama's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adaptive.errors import AdaptiveError
from adaptive.record import record

if TYPE_CHECKING:
    from adaptive.plan.architecture.presets import ModelSpec


@record
class Family:
    """What one transformers decoder class is built of beyond its config's sizes."""

    model_type: str
    class_name: str  # transformers' *ForCausalLM
    attention: tuple[str, ...]  # the attention's nn.Linear modules ("qkv_proj": q, k and v in one)
    mlp: tuple[str, ...]  # a dense MLP's nn.Linear modules ("gate_up_proj": gate and up in one)
    qk_norm: bool = False  # an RMSNorm over head_dim on q and on k (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # Gemma 2/3: a norm after the attention and before and after the MLP (4 a layer)
    norm: str = "llama"  # "llama": w * x in the input dtype; "gemma": x * (1 + w) in fp32
    activation: str = "silu"  # "gelu_tanh" (Gemma)
    experts: str = "none"  # "3d": routed experts as [E, 2I, H] and [E, H, I] parameters, not nn.Linear modules
    shared_expert: bool = False  # Qwen2-MoE: an always-on SwiGLU (nn.Linear) and a Linear(h, 1) gate on it
    qkv_bias: bool | None = False  # q/k/v biases: None where config.json's `attention_bias` decides; Qwen2: always
    o_bias_from_attention_bias: bool = False  # o_proj's bias follows `attention_bias` too (Qwen3, Gemma)
    default_attention: str = "sdpa"  # Gemma 2: eager (transformers' class refuses sdpa, which cannot softcap)
    default_head_dim: int | None = None  # the config class's head_dim when config.json omits it; None: hidden / heads
    default_tie: bool = False  # the config class's tie_word_embeddings
    default_qkv_bias_key: str = "attention_bias"  # the config.json key of the q/k/v bias where it is configurable

    @property
    def fused_qkv(self) -> bool:
        return "qkv_proj" in self.attention

    @property
    def fused_gate_up(self) -> bool:
        return "gate_up_proj" in self.mlp

    @property
    def norms_per_layer(self) -> int:
        return 4 if self.sandwich_norms else 2


LLAMA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LLAMA_MLP = ("gate_proj", "up_proj", "down_proj")

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("adaptive", "AdaptiveForCausalLM", LLAMA_ATTENTION, LLAMA_MLP, qkv_bias=None),
    Family("llama", "LlamaForCausalLM", LLAMA_ATTENTION, LLAMA_MLP, qkv_bias=None, o_bias_from_attention_bias=True),
    Family("mistral", "MistralForCausalLM", LLAMA_ATTENTION, LLAMA_MLP),
    Family("qwen2", "Qwen2ForCausalLM", LLAMA_ATTENTION, LLAMA_MLP, qkv_bias=True),
    Family("qwen3", "Qwen3ForCausalLM", LLAMA_ATTENTION, LLAMA_MLP, qk_norm=True, qkv_bias=None,
           o_bias_from_attention_bias=True, default_head_dim=128),
    Family("gemma2", "Gemma2ForCausalLM", LLAMA_ATTENTION, LLAMA_MLP, sandwich_norms=True, norm="gemma",
           activation="gelu_tanh", qkv_bias=None, o_bias_from_attention_bias=True, default_attention="eager",
           default_head_dim=256, default_tie=True),
    Family("gemma3_text", "Gemma3ForCausalLM", LLAMA_ATTENTION, LLAMA_MLP, qk_norm=True, sandwich_norms=True,
           norm="gemma", activation="gelu_tanh", qkv_bias=None, o_bias_from_attention_bias=True,
           default_head_dim=256, default_tie=True),
    Family("phi3", "Phi3ForCausalLM", ("qkv_proj", "o_proj"), ("gate_up_proj", "down_proj")),
    Family("mixtral", "MixtralForCausalLM", LLAMA_ATTENTION, LLAMA_MLP, experts="3d"),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", LLAMA_ATTENTION, LLAMA_MLP, qk_norm=True, experts="3d", qkv_bias=None,
           o_bias_from_attention_bias=True),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", LLAMA_ATTENTION, LLAMA_MLP, experts="3d", shared_expert=True,
           qkv_bias=None, default_qkv_bias_key="qkv_bias"),
)}
HF_TYPES = tuple(t for t in FAMILIES if t != "adaptive")  # the transformers decoders a config.json may name


def family_of(spec: ModelSpec) -> Family:
    """The family of a spec: its config.json's model_type, or ours (presets, our exports)."""
    return FAMILIES.get(spec.model_type, FAMILIES["adaptive"])


@record
class LinearModule:
    """One kind of nn.Linear in a model: its name inside a decoder layer (or at the top), its shape, how many. As a
    LoRA target it may also be a parameter PEFT adapts in place (a router's weight, 3D experts: `experts` of them)."""

    name: str  # "self_attn.q_proj", "mlp.down_proj", "mlp.shared_expert.gate_proj", "lm_head", "mlp.experts.down_proj"
    in_features: int
    out_features: int
    count: int  # modules of this kind in the model
    bias: bool = False
    role: str = "attention"  # attention | mlp | shared_expert | head | router | experts (the last two: parameters)
    experts: int = 1  # a 3D expert parameter: PEFT's adapter has rank x experts rows (lora/layer.py ParamWrapper)
    rank_factor: int = 1  # PEFT doubles rank and alpha on a fused gate_up_proj (two transformers 4 targets in one)

    def adapter_params(self, rank: int) -> int:
        """PEFT's LoRA A and B on this target: rank x (in + out), per expert, per module."""
        return self.count * rank * self.rank_factor * self.experts * (self.in_features + self.out_features)

    @property
    def leaf(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def weight_params(self) -> int:
        return self.in_features * self.out_features

    @property
    def params(self) -> int:
        """Parameters of one module: its weight and bias."""
        return self.weight_params + (self.out_features if self.bias else 0)


def linear_modules(spec: ModelSpec) -> tuple[LinearModule, ...]:
    """Every nn.Linear of the model (what PEFT's "all-linear" and bitsandbytes see), the LM head last. Routed
    experts stored as 3D parameters and transformers 5's top-k routers are not nn.Linear modules: not here."""
    from adaptive.plan.architecture.blocks import block_type

    f = family_of(spec)
    h, q, kv = spec.hidden_size, spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    layers = spec.num_hidden_layers
    out: list[LinearModule] = []
    if f.fused_qkv:
        out.append(LinearModule("self_attn.qkv_proj", h, q + 2 * kv, layers, spec.qkv_bias))
    else:
        for name, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out.append(LinearModule(f"self_attn.{name}", h, width, layers, spec.qkv_bias))
    out.append(LinearModule("self_attn.o_proj", q, h, layers, spec.o_bias))
    dense = sum(not block_type(t).has_experts for t in spec.layer_types)
    shared = spec.num_moe_layers if spec.shared_expert_intermediate_size else 0
    for prefix, width, count, role in (("mlp", spec.intermediate_size, dense, "mlp"),
                                       ("mlp.shared_expert", spec.shared_expert_intermediate_size, shared,
                                        "shared_expert")):
        if not count:
            continue
        if f.fused_gate_up:
            out.append(LinearModule(f"{prefix}.gate_up_proj", h, 2 * width, count, spec.mlp_bias, role))
        else:
            out += [LinearModule(f"{prefix}.gate_proj", h, width, count, spec.mlp_bias, role),
                    LinearModule(f"{prefix}.up_proj", h, width, count, spec.mlp_bias, role)]
        out.append(LinearModule(f"{prefix}.down_proj", width, h, count, spec.mlp_bias, role))
    if shared:
        out.append(LinearModule("mlp.shared_expert_gate", h, 1, shared, False, "shared_expert"))
    out.append(LinearModule("lm_head", h, spec.vocab_size, 1, False, "head"))
    return tuple(out)


# --lora-targets: PEFT's own words, and ours for the attention's linears
TARGET_ALIASES = ("all-linear", "attention")

# PEFT 0.21 on transformers 5's fused MoE classes (peft/utils/transformers_weight_conversion.py, _MOE_TARGET_MODULE_
# MAPPING): the targets transformers 4 named (the router "gate", each expert's projections) become target_parameters on
# the router's weight and the 3D experts, and "all-linear" includes them. Mixtral, and Qwen3-MoE through its
# Qwen2-MoE pattern; Qwen2-MoE itself has no pattern there, so LoRA reaches its nn.Linear modules only.
PEFT_MOE_TARGETS = {
    "mixtral": {"gate": "router", "w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"},
    "qwen3_moe": {"gate": "router", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"},
}


def _moe_sites(spec: ModelSpec) -> dict[str, LinearModule]:
    """The parameters PEFT adapts in a fused MoE block, by what PEFT_MOE_TARGETS maps to: the router's [E, h] weight,
    gate_up_proj [E, 2f, h] (rank and alpha doubled: two transformers 4 targets fused) and down_proj [E, h, f]."""
    h, f, e, n = spec.hidden_size, spec.moe_intermediate_size, spec.num_local_experts, spec.num_moe_layers
    return {"router": LinearModule("mlp.gate", h, e, n, role="router"),
            "gate_up_proj": LinearModule("mlp.experts.gate_up_proj", h, 2 * f, n, role="experts", experts=e,
                                         rank_factor=2),
            "down_proj": LinearModule("mlp.experts.down_proj", f, h, n, role="experts", experts=e)}


def resolve_targets(spec: ModelSpec, targets: str) -> tuple[LinearModule, ...]:
    """What `targets` adapts, as PEFT's LoraConfig(target_modules=...) picks it: "all-linear" (every nn.Linear but
    the output layer), "attention" (the attention's), or module names ("q_proj,v_proj"; a name matches a module whose
    dotted name is it or ends with "." + it). On Mixtral and Qwen3-MoE, transformers 4's MoE names reach the router and
    the 3D experts (PEFT_MOE_TARGETS), and take the MLP names of dense layers with them. AdaptiveError for a name that
    matches nothing, naming what this model has."""
    modules = [m for m in linear_modules(spec) if m.role != "head"]
    moe = PEFT_MOE_TARGETS.get(spec.model_type, {}) if spec.is_moe else {}
    key = targets.strip()
    if key == "attention":
        return tuple(m for m in modules if m.role == "attention")
    if key == "all-linear":
        names = [*dict.fromkeys(m.leaf for m in modules), *moe]
    else:
        names = [n.strip() for n in key.split(",") if n.strip()]
        if not names:
            raise AdaptiveError(f"--lora-targets is empty; give all-linear, attention or module names such as "
                                f"{','.join(m.leaf for m in modules[:2])}")
    chosen: dict[str, LinearModule] = {}
    sites = _moe_sites(spec) if moe else {}
    valid = sorted({m.leaf for m in modules} | {m.name for m in modules} | set(moe))
    for n in names:
        if n in moe:  # PEFT moves it to target_parameters: the module of that name in a dense layer is not adapted
            site = sites[moe[n]]
            chosen[site.name] = site
            continue
        hits = [m for m in modules if m.name == n or m.name.endswith("." + n)]
        if not hits:
            raise AdaptiveError(_no_match(spec, n, valid))
        chosen.update((m.name, m) for m in hits)
    for fused, parts in (("gate_up_proj", [k for k, v in moe.items() if v == "gate_up_proj"]),):
        named = [p for p in parts if p in names]
        if named and len(named) < len(parts):  # PEFT raises ValueError
            raise AdaptiveError(f"--lora-targets {','.join(named)} needs {','.join(p for p in parts if p not in named)} "
                                f"too: transformers 5 fuses them into {fused}, which PEFT adapts as one")
    return tuple(m for m in [*modules, *sites.values()] if m.name in chosen)


def peft_target_modules(spec: ModelSpec, targets: str) -> str | list[str]:
    """`--lora-targets` as PEFT's LoraConfig(target_modules=...) takes it: "all-linear" and module names as they are,
    "attention" (ours) as the family's attention linears. resolve_targets says what PEFT makes of it."""
    resolve_targets(spec, targets)  # a name that matches nothing: one line here, not PEFT's ValueError later
    if targets == "attention":
        return list(family_of(spec).attention)
    if targets == "all-linear":
        return targets
    return [n.strip() for n in targets.split(",") if n.strip()]


def _no_match(spec: ModelSpec, name: str, valid: list[str]) -> str:
    from adaptive.errors import closest

    f = family_of(spec)
    why = ""
    if name in ("lm_head", "embed_tokens"):
        why = f": LoRA here adapts the decoder layers' linears, not {name}"
    elif f.experts == "3d" and name in ("experts", "gate", "gate_up_proj", "down_proj", "w1", "w2", "w3"):
        reach = (f" (PEFT reaches them by transformers 4's names: {', '.join(PEFT_MOE_TARGETS[f.model_type])})"
                 if f.model_type in PEFT_MOE_TARGETS else "")
        why = (f": {f.class_name} stores its routed experts as 3D parameters and routes with a top-k router, "
               f"not nn.Linear modules{reach}")
    near = closest(name, valid)
    hint = f"; did you mean {near}?" if near else ""
    return (f"--lora-targets {name!r} matches no linear layer of this {f.model_type} model{why}{hint} "
            f"(all-linear, attention, or: {', '.join(v for v in valid if '.' not in v)})")


__all__ = ["FAMILIES", "Family", "HF_TYPES", "LinearModule", "PEFT_MOE_TARGETS", "TARGET_ALIASES", "family_of",
           "linear_modules", "peft_target_modules", "resolve_targets"]
