"""The fields of a `config.json` the planner reads, checked before any arithmetic.

Types are strict (no `"256"`, `true` or `256.0` where an integer goes), sizes positive, numbers finite,
and the rules across fields that transformers itself would trip over later are checked here: hidden size
divisible by the heads (without `head_dim`), heads divisible by the KV heads, top-k within the experts,
and for our own exported config a per-layer pattern as long as the layers. Keys we do not read are
left alone (a config.json carries many).

A table of fields and a few lines of checks rather than pydantic models: building those models took 0.15 s, most
of what `adaptive fit --model PATH/config.json` spent beyond a preset's plan (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

from adaptive.errors import AdaptiveError

# (model_type) -> (the key that counts the experts, its default, the top-k default): transformers' defaults
EXPERT_KEYS = {"mixtral": ("num_local_experts", 8, 2), "qwen2_moe": ("num_experts", 60, 4),
               "qwen3_moe": ("num_experts", 128, 8), "adaptive": ("num_local_experts", 0, 0)}

# field -> (kind, default); a kind is "count" (integer > 0), "size" (integer >= 0), "positive" (number > 0),
# "fraction" (number in (0, 1]), "bool", "str", "sizes" (list of sizes), "strs" (list of strings), "rope" (object)
REQUIRED = object()
HF_FIELDS: dict[str, tuple[str, Any]] = {
    "model_type": ("str", REQUIRED), "hidden_size": ("count", REQUIRED), "num_attention_heads": ("count", REQUIRED),
    "num_key_value_heads": ("count", None), "num_hidden_layers": ("count", REQUIRED), "head_dim": ("count", None),
    "vocab_size": ("count", REQUIRED), "intermediate_size": ("count", REQUIRED),
    "max_position_embeddings": ("count", None), "rope_theta": ("positive", None), "rope_parameters": ("rope", None),
    "tie_word_embeddings": ("bool", False), "attention_bias": ("bool", False), "mlp_bias": ("bool", False),
    "qkv_bias": ("bool", None), "o_bias": ("bool", False), "num_local_experts": ("count", None),
    "num_experts": ("count", None), "num_experts_per_tok": ("count", None), "decoder_sparse_step": ("count", None),
    "mlp_only_layers": ("sizes", None), "moe_intermediate_size": ("count", None),
    "shared_expert_intermediate_size": ("count", None),
    "attn_logit_softcapping": ("positive", None), "final_logit_softcapping": ("positive", None),  # Gemma 2
    "_name_or_path": ("str", None),
}
# our own export: the layer pattern and the MoE/MoD sizes are fields too (0 where absent)
ADAPTIVE_FIELDS: dict[str, tuple[str, Any]] = {
    **HF_FIELDS, "arch": ("str", None), "preset": ("str", None), "block_types": ("strs", None),
    "num_local_experts": ("size", 0), "num_experts_per_tok": ("size", 0), "moe_intermediate_size": ("size", 0),
    "mod_capacity": ("fraction", 1.0), "mod_predictor_hidden_size": ("size", 0),
}
RULES = {"count": "must be an integer", "size": "must be an integer", "positive": "must be a number",
         "fraction": "must be a number", "bool": "must be true or false", "str": "must be a string",
         "sizes": "must be a list", "strs": "must be a list", "rope": "must be an object"}


class _Bad(Exception):
    """A field's value breaks its rule: (the field's dotted name, the rule, the value)."""


def _check(name: str, kind: str, value: Any) -> Any:
    """The value if it keeps its kind's rule, else _Bad(name, rule, value)."""
    if kind in ("count", "size"):
        if type(value) is not int:
            raise _Bad(name, RULES[kind], value)
        if value <= 0 if kind == "count" else value < 0:
            raise _Bad(name, "must be positive" if kind == "count" else "must be at least 0", value)
        return value
    if kind in ("positive", "fraction"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Bad(name, RULES[kind], value)
        if not math.isfinite(value):
            raise _Bad(name, "must be a finite number", value)
        if value <= 0:
            raise _Bad(name, "must be positive", value)
        if kind == "fraction" and value > 1:
            raise _Bad(name, "must be at most 1", value)
        return value
    if kind == "bool":
        if type(value) is not bool:
            raise _Bad(name, RULES[kind], value)
        return value
    if kind == "str":
        if type(value) is not str:
            raise _Bad(name, RULES[kind], value)
        return value
    if kind in ("sizes", "strs"):
        if not isinstance(value, list):
            raise _Bad(name, RULES[kind], value)
        return [_check(f"{name}.{i}", "size" if kind == "sizes" else "str", v) for i, v in enumerate(value)]
    if not isinstance(value, dict):  # rope
        raise _Bad(name, RULES[kind], value)
    theta = value.get("rope_theta")
    return SimpleNamespace(rope_theta=None if theta is None else _check(f"{name}.rope_theta", "positive", theta))


def _across_fields(f: SimpleNamespace, adaptive: bool) -> str | None:
    """The first rule across fields that `f` breaks."""
    h, heads, kv = f.hidden_size, f.num_attention_heads, f.num_key_value_heads or f.num_attention_heads
    if not f.head_dim and h % heads:
        return f"hidden_size ({h}) is not divisible by num_attention_heads ({heads}) and no head_dim is given"
    if heads % kv:
        return f"num_attention_heads ({heads}) must be divisible by num_key_value_heads ({kv})"
    if adaptive:
        if f.block_types is not None and len(f.block_types) != f.num_hidden_layers:
            return f"block_types lists {len(f.block_types)} layers, num_hidden_layers is {f.num_hidden_layers}"
        if f.num_experts_per_tok > f.num_local_experts:
            return (f"num_experts_per_tok ({f.num_experts_per_tok}) must be at most num_local_experts "
                    f"({f.num_local_experts})")
    elif f.model_type in EXPERT_KEYS:
        key, experts_default, k_default = EXPERT_KEYS[f.model_type]
        experts = getattr(f, key) or experts_default
        top_k = f.num_experts_per_tok or k_default
        if top_k > experts:
            return f"num_experts_per_tok ({top_k}) must be at most {key} ({experts})"
    return None


def check_fields(cfg: dict[str, Any], path: str) -> Any:
    """The validated fields of `cfg` (attributes by HF name; `_name_or_path` as `name_or_path`); AdaptiveError naming
    the first bad one: `config.json 'PATH': field rule, got value`."""
    where = f"config.json {path!r}"
    adaptive = cfg.get("model_type") == "adaptive"
    values: dict[str, Any] = {}
    try:
        for name, (kind, default) in (ADAPTIVE_FIELDS if adaptive else HF_FIELDS).items():
            if name not in cfg:
                if default is REQUIRED:
                    raise AdaptiveError(f"{where} lacks {name!r}")
                values[name] = default
            elif cfg[name] is None and default is not REQUIRED:
                values[name] = default
            else:
                values[name] = _check(name, kind, cfg[name])
    except _Bad as bad:
        field, rule, value = bad.args
        got = repr(value)
        raise AdaptiveError(f"{where}: {field} {rule}, got {got if len(got) <= 60 else got[:57] + '...'}") from None
    values["name_or_path"] = values.pop("_name_or_path")
    fields = SimpleNamespace(**values)
    if rule := _across_fields(fields, adaptive):
        raise AdaptiveError(f"{where}: {rule}")
    return fields


__all__ = ["EXPERT_KEYS", "check_fields"]
