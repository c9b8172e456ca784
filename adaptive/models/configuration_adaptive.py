"""`AdaptiveConfig`: one typed config for dense, MoE, MoD and hybrid decoders.

Shapes come from `adaptive.plan.architecture.presets` (`from_preset` / `from_spec`), so the planner and the model
count the same parameters. The per-layer pattern is `block_types` (dense | moe | mod | hybrid).

Why not `layer_types`: transformers 5 reserves `config.layer_types` for *attention* kinds
("full_attention", "sliding_attention", ...). `DynamicCache(config=...)` reads it to pick cache layers
(and maps "moe" to a cache-less dummy layer), so our pattern lives in `block_types`, and
`layer_types` is a read-only property saying every layer is full attention.
"""

from __future__ import annotations

from dataclasses import fields

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from adaptive.errors import AdaptiveError, closest
from adaptive.plan.architecture.blocks import block_type
from adaptive.plan.architecture.presets import LAYER_TYPES, ModelSpec, preset_spec

MOE_IMPLEMENTATIONS = ("native", "deepspeed")
MOD_ROUTING = ("auto", "topk", "causal")
MOD_ROUTER_WEIGHTS = ("sigmoid", "logit", "none")
NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
KERNELS = ("lean", "plain")

# `preset_spec` knobs that shape the layer pattern; the HF-named config fields map onto them.
_SPEC_KNOBS = {
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "top_k",
    "mod_capacity": "mod_capacity",
    "moe_layer_freq": "moe_layer_freq",
    "mod_layer_freq": "mod_layer_freq",
}


# Tensor parallelism (transformers' tp_plan, which DeepSpeed's AutoTP training reads): Llama's plan for the
# attention and the SwiGLU MLP, and the same for DeepSpeed-MoE's experts (expert tensor parallelism). The native
# block's 3D experts, routers and norms are not in it.
_ATTENTION_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
}
_MLP_TP_PLAN = {
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
_EXPERTS_TP_PLAN = {
    "layers.*.mlp.deepspeed_moe.experts.deepspeed_experts.*.gate_proj": "colwise",
    "layers.*.mlp.deepspeed_moe.experts.deepspeed_experts.*.up_proj": "colwise",
    "layers.*.mlp.deepspeed_moe.experts.deepspeed_experts.*.down_proj": "rowwise",
}


@strict
class AdaptiveConfig(PreTrainedConfig):
    r"""Config of `AdaptiveModel` / `AdaptiveForCausalLM`.

    `AdaptiveConfig()` is the `debug` preset, dense. Build real ones with
    `AdaptiveConfig.from_preset("b1", arch="hybrid")`.

    MoE fields follow Mixtral and DeepSpeed (`deepspeed.moe.layer.MoE`): `num_local_experts`,
    `num_experts_per_tok` (1 or 2), `moe_intermediate_size`, `router_aux_loss_coef`,
    `router_z_loss_coef`, `moe_implementation` ("native" | "deepspeed"), `ep_size`, `capacity_factor`,
    `eval_capacity_factor` (None: never drop in eval, which keeps generation causal and
    batch-independent), `min_capacity`, `drop_tokens`, `noisy_gate_policy`, `top2_2nd_expert_sampling`.

    MoD fields: `mod_capacity` (fraction of each sequence a routed block processes), `mod_aux_loss_coef`
    (weight of the BCE losses that train the causal router/predictor), `mod_predictor_hidden_size`
    (0: route causally with the router's own logit), `mod_routing` ("auto": top-k in training,
    causal in eval), `mod_router_weight` (what scales the block's output delta: "sigmoid" of the router
    logit, the raw "logit" as in the paper, or "none" = 1).
    """

    model_type = "adaptive"
    keys_to_ignore_at_inference = ["cache"]

    default_theta = 10000.0

    # shape (debug preset)
    vocab_size: int = 2048
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 5
    num_attention_heads: int = 4
    num_key_value_heads: int | None = 2
    head_dim: int | None = None
    block_types: list[str] | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rope_parameters: RopeParameters | dict | None = None
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float | int = 0.0
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    # MoE
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.0
    output_router_logits: bool = False
    moe_implementation: str = "native"
    ep_size: int = 1
    capacity_factor: float | int = 1.0
    eval_capacity_factor: float | int | None = None
    min_capacity: int = 4
    drop_tokens: bool = True
    noisy_gate_policy: str | None = None
    top2_2nd_expert_sampling: bool = False
    # MoD
    mod_capacity: float | int = 1.0
    mod_predictor_hidden_size: int = 0
    mod_aux_loss_coef: float = 0.1
    mod_routing: str = "auto"
    mod_router_weight: str = "sigmoid"
    # "lean": RMSNorm, SwiGLU and the training loss save fewer bytes for backward (same values; see
    # lean.py); "plain": transformers' Llama ops, tensor for tensor
    kernels: str = "lean"
    # provenance
    preset: str | None = None
    arch: str | None = None

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.block_types is None:
            self.block_types = ["dense"] * self.num_hidden_layers
        self.block_types = list(self.block_types)
        if self.rope_parameters is None and "rope_theta" not in kwargs:
            self.rope_parameters = {"rope_type": "default", "rope_theta": self.default_theta}
        super().__post_init__(**kwargs)
        self.check()

    # transformers' meaning of `layer_types` (attention kind per layer): all full attention.
    @property
    def layer_types(self) -> list[str]:
        return ["full_attention"] * self.num_hidden_layers

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.block_types) if block_type(t).has_experts]

    @property
    def mod_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.block_types) if block_type(t).routed]

    # transformers' tensor-parallel plan (a class attribute on Llama's config): only the projections this
    # config's layers have; transformers adds the input embedding, and `AdaptiveForCausalLM._tp_plan` the head
    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        has_mlp = any(not block_type(t).has_experts for t in self.block_types)
        experts = self.moe_implementation == "deepspeed" and bool(self.moe_layers)
        return {**_ATTENTION_TP_PLAN, **(_MLP_TP_PLAN if has_mlp else {}), **(_EXPERTS_TP_PLAN if experts else {})}

    def validate_adaptive(self) -> None:
        """Run by `@strict` at save time; `__post_init__` runs the same checks at construction."""
        self.check()

    def check(self) -> None:
        """Raise AdaptiveError for settings the model cannot build or run."""
        _check(self)

    @classmethod
    def from_preset(cls, name: str, arch: str = "dense", **overrides) -> AdaptiveConfig:
        """The preset `name` as `arch`, from the same data `adaptive fit` plans with.

        Overrides that shape the layer pattern (`num_local_experts`, `num_experts_per_tok`,
        `mod_capacity`, `moe_layer_freq`, `mod_layer_freq`) go through `preset_spec`; the rest are
        config fields.
        """
        knobs = {_SPEC_KNOBS[k]: overrides.pop(k) for k in list(overrides) if k in _SPEC_KNOBS}
        return cls.from_spec(preset_spec(name, arch, **knobs), **overrides)

    @classmethod
    def from_spec(cls, spec: ModelSpec, **overrides) -> AdaptiveConfig:
        """A config from a planner `ModelSpec`; `overrides` are config fields."""
        if spec.shared_expert_intermediate_size:
            raise AdaptiveError(
                f"shared_expert_intermediate_size ({spec.shared_expert_intermediate_size}) is not supported: "
                "adaptive builds Mixtral-style MoE layers without a shared expert; use 0"
            )
        known = {f.name for f in fields(cls)} | {"attn_implementation", "dtype"}
        for key in overrides:
            if key not in known:
                near = closest(key, known)
                hint = f"; did you mean {near}?" if near else ""
                raise AdaptiveError(f"unknown AdaptiveConfig field {key!r}{hint}")
        values = dict(
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_hidden_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            head_dim=spec.head_dim,
            block_types=list(spec.layer_types),
            max_position_embeddings=spec.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
            tie_word_embeddings=spec.tie_word_embeddings,
            qkv_bias=spec.qkv_bias,
            o_bias=spec.o_bias,
            mlp_bias=spec.mlp_bias,
            num_local_experts=spec.num_local_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            mod_capacity=spec.mod_capacity,
            mod_predictor_hidden_size=spec.mod_predictor_hidden_size,
            preset=spec.name,
            arch=spec.arch,
        )
        values.update(overrides)
        if "num_hidden_layers" in overrides and "block_types" not in overrides:
            raise AdaptiveError("override block_types together with num_hidden_layers, or pick another preset")
        return cls(**values)

    def to_spec(self) -> ModelSpec:
        """The planner's view of this config: `count_params(config.to_spec())` counts this model."""
        return ModelSpec(
            name=self.preset or "custom",
            arch=self.arch or "custom",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            layer_types=tuple(self.block_types),
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=float(self.rope_parameters.get("rope_theta", self.default_theta)),
            tie_word_embeddings=self.tie_word_embeddings,
            qkv_bias=self.qkv_bias,
            o_bias=self.o_bias,
            mlp_bias=self.mlp_bias,
            num_local_experts=self.num_local_experts if self.moe_layers else 0,
            num_experts_per_tok=self.num_experts_per_tok if self.moe_layers else 0,
            moe_intermediate_size=self.moe_intermediate_size if self.moe_layers else 0,
            mod_capacity=self.mod_capacity if self.mod_layers else 1.0,
            mod_predictor_hidden_size=self.mod_predictor_hidden_size if self.mod_layers else 0,
        )


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        shown = ", ".join(repr(c) for c in choices)
        near = closest(value, [c for c in choices if isinstance(c, str)]) if isinstance(value, str) else None
        hint = f"; did you mean {near!r}?" if near else ""
        raise AdaptiveError(f"{name} must be one of {shown}, got {value!r}{hint}")


def _check(c: AdaptiveConfig) -> None:
    if len(c.block_types) != c.num_hidden_layers:
        raise AdaptiveError(
            f"block_types has {len(c.block_types)} entries but num_hidden_layers is {c.num_hidden_layers}"
        )
    for t in c.block_types:
        _choice("block_types entry", t, LAYER_TYPES)
    if c.num_attention_heads % c.num_key_value_heads:
        raise AdaptiveError(
            f"num_attention_heads ({c.num_attention_heads}) must be divisible by num_key_value_heads "
            f"({c.num_key_value_heads})"
        )
    if c.head_dim % 2:
        raise AdaptiveError(f"head_dim ({c.head_dim}) must be even for rotary embeddings")
    _choice("moe_implementation", c.moe_implementation, MOE_IMPLEMENTATIONS)
    _choice("mod_routing", c.mod_routing, MOD_ROUTING)
    _choice("mod_router_weight", c.mod_router_weight, MOD_ROUTER_WEIGHTS)
    _choice("noisy_gate_policy", c.noisy_gate_policy, NOISY_GATE_POLICIES)
    _choice("kernels", c.kernels, KERNELS)
    if c.moe_layers:
        if c.num_local_experts < 1:
            raise AdaptiveError(f"num_local_experts must be at least 1 for MoE layers, got {c.num_local_experts}")
        if c.num_experts_per_tok not in (1, 2) or c.num_experts_per_tok > c.num_local_experts:
            raise AdaptiveError(
                f"num_experts_per_tok ({c.num_experts_per_tok}) must be 1 or 2 and at most num_local_experts "
                f"({c.num_local_experts}): DeepSpeed's MoE gate supports top-1 and top-2"
            )
        if c.moe_intermediate_size < 1:
            raise AdaptiveError(f"moe_intermediate_size must be positive, got {c.moe_intermediate_size}")
        if c.ep_size < 1 or c.num_local_experts % c.ep_size:
            raise AdaptiveError(
                f"num_local_experts ({c.num_local_experts}) must be divisible by ep_size ({c.ep_size})"
            )
        if c.ep_size > 1 and c.moe_implementation != "deepspeed":
            raise AdaptiveError(
                f"ep_size ({c.ep_size}) > 1 needs moe_implementation='deepspeed'; native MoE holds every expert"
            )
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(c, name)
            if value is not None and value <= 0:
                raise AdaptiveError(f"{name} must be positive, got {value}")
        if c.min_capacity < 0:
            raise AdaptiveError(f"min_capacity must be >= 0, got {c.min_capacity}")
    if c.mod_layers:
        if not 0.0 < c.mod_capacity <= 1.0:
            raise AdaptiveError(f"mod_capacity must be in (0, 1], got {c.mod_capacity}")
        if c.mod_predictor_hidden_size < 0:
            raise AdaptiveError(f"mod_predictor_hidden_size must be >= 0, got {c.mod_predictor_hidden_size}")


__all__ = ["AdaptiveConfig", "KERNELS", "MOE_IMPLEMENTATIONS", "MOD_ROUTING", "MOD_ROUTER_WEIGHTS"]
