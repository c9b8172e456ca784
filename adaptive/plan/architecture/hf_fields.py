"""The fields of a `config.json` the planner reads, checked by pydantic before any arithmetic.

Types are strict (no `"256"`, `true` or `256.0` where an integer goes), sizes positive, numbers finite,
and the rules across fields that transformers itself would trip over later are checked here: hidden size
divisible by the heads (without `head_dim`), heads divisible by the KV heads, top-k within the experts,
and for our own exported config a per-layer pattern as long as the layers. Keys we do not read are
left alone (a config.json carries many). pydantic is imported only when a file is read, so `adaptive
fit` on a preset does not pay for it.
"""

from __future__ import annotations

from typing import Any

from adaptive.errors import AdaptiveError, from_validation

# (model_type) -> (the key that counts the experts, its default, the top-k default): transformers' defaults
EXPERT_KEYS = {"mixtral": ("num_local_experts", 8, 2), "qwen2_moe": ("num_experts", 60, 4),
               "qwen3_moe": ("num_experts", 128, 8), "adaptive": ("num_local_experts", 0, 0)}


def _models() -> tuple[type, type]:
    """The pydantic models, built on first use (pydantic costs a tenth of a second to import)."""
    global _MODELS
    if _MODELS is not None:
        return _MODELS
    from typing import Annotated

    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

    count = Annotated[int, Field(strict=True, gt=0)]
    size = Annotated[int, Field(strict=True, ge=0)]  # 0: absent (our exports write 0 for no experts)
    positive = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]

    class Rope(BaseModel):
        model_config = ConfigDict(extra="allow")
        rope_theta: positive | None = None

    class HFFields(BaseModel):
        model_config = ConfigDict(extra="allow", populate_by_name=True)
        model_type: StrictStr
        hidden_size: count
        num_attention_heads: count
        num_key_value_heads: count | None = None
        num_hidden_layers: count
        head_dim: count | None = None
        vocab_size: count
        intermediate_size: count
        max_position_embeddings: count | None = None
        rope_theta: positive | None = None
        rope_parameters: Rope | None = None
        tie_word_embeddings: StrictBool = False
        attention_bias: StrictBool = False
        mlp_bias: StrictBool = False
        qkv_bias: StrictBool | None = None
        o_bias: StrictBool = False
        num_local_experts: count | None = None
        num_experts: count | None = None
        num_experts_per_tok: count | None = None
        decoder_sparse_step: count | None = None
        mlp_only_layers: list[size] | None = None
        moe_intermediate_size: count | None = None
        shared_expert_intermediate_size: count | None = None
        attn_logit_softcapping: positive | None = None  # Gemma 2
        final_logit_softcapping: positive | None = None  # Gemma 2 (Gemma 3: null)
        name_or_path: StrictStr | None = Field(None, alias="_name_or_path")

        @model_validator(mode="after")
        def _across_fields(self) -> HFFields:
            h, heads, kv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads or self.num_attention_heads
            if not self.head_dim and h % heads:
                raise ValueError(f"hidden_size ({h}) is not divisible by num_attention_heads ({heads}) and no head_dim "
                                 "is given")
            if heads % kv:
                raise ValueError(f"num_attention_heads ({heads}) must be divisible by num_key_value_heads ({kv})")
            if self.model_type in EXPERT_KEYS and self.model_type != "adaptive":
                key, experts_default, k_default = EXPERT_KEYS[self.model_type]
                experts = getattr(self, key) or experts_default
                top_k = self.num_experts_per_tok or k_default
                if top_k > experts:
                    raise ValueError(f"num_experts_per_tok ({top_k}) must be at most {key} ({experts})")
            return self

    class AdaptiveFields(HFFields):
        """Our own export: the layer pattern and the MoE/MoD sizes are fields too (0 where absent)."""

        arch: StrictStr | None = None
        preset: StrictStr | None = None
        block_types: list[StrictStr] | None = None
        num_local_experts: size = 0
        num_experts_per_tok: size = 0
        moe_intermediate_size: size = 0
        mod_capacity: Annotated[float, Field(strict=True, gt=0, le=1, allow_inf_nan=False)] = 1.0
        mod_predictor_hidden_size: size = 0

        @model_validator(mode="after")
        def _pattern(self) -> AdaptiveFields:
            layers = self.num_hidden_layers
            if self.block_types is not None and len(self.block_types) != layers:
                raise ValueError(f"block_types lists {len(self.block_types)} layers, num_hidden_layers is {layers}")
            if self.num_experts_per_tok > self.num_local_experts:
                raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be at most num_local_experts "
                                 f"({self.num_local_experts})")
            return self

    _MODELS = (HFFields, AdaptiveFields)
    return _MODELS


_MODELS: tuple[type, type] | None = None


def check_fields(cfg: dict[str, Any], path: str) -> Any:
    """The validated fields of `cfg` (attributes by HF name); AdaptiveError naming the first bad one."""
    from pydantic import ValidationError

    hf, ours = _models()
    model = ours if cfg.get("model_type") == "adaptive" else hf
    try:
        return model.model_validate(cfg)
    except ValidationError as err:
        raise from_validation(f"config.json {path!r}", err) from None
    except (TypeError, AttributeError) as err:  # pragma: no cover - pydantic reports type errors itself
        raise AdaptiveError(f"config.json {path!r}: {err}") from None


__all__ = ["EXPERT_KEYS", "check_fields"]
