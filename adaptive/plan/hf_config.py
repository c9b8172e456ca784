"""Read a transformers `config.json` (Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE) into a ModelSpec.

Pure JSON reading, so users can fit their own models offline without torch or transformers.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from adaptive.errors import AdaptiveError, unknown
from adaptive.plan.blocks import block_type
from adaptive.plan.presets import (ARCHS, DEFAULT_MOD_CAPACITY, DEFAULT_NUM_EXPERTS, DEFAULT_TOP_K,
                                    ModelSpec, layer_pattern)

DENSE_TYPES = ("llama", "mistral", "qwen2")
MOE_TYPES = ("mixtral", "qwen2_moe")
SUPPORTED_TYPES = DENSE_TYPES + MOE_TYPES + ("adaptive",)


def looks_like_path(model: str) -> bool:
    return model.endswith(".json") or "/" in model or Path(model).is_dir()


def read_config_json(path: str | Path) -> dict:
    """The parsed JSON object of a config file (or of `config.json` inside a folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise AdaptiveError(f"model config {str(path)!r} does not exist; give a preset name or a config.json path")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise AdaptiveError(f"malformed config.json {str(path)!r}: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (UnicodeDecodeError, OSError) as e:
        raise AdaptiveError(f"cannot read config.json {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise AdaptiveError(f"malformed config.json {str(path)!r}: expected a JSON object, got {type(data).__name__}")
    return data


def _field(cfg: dict, key: str, path: str, kind: type = int, default=None):
    value = cfg.get(key, default)
    if value is None:
        raise AdaptiveError(f"config.json {path!r} lacks {key!r}, which a {cfg.get('model_type')} config needs")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise AdaptiveError(f"config.json {path!r}: {key} must be an integer, got {value!r}")
    if kind is int and value <= 0:
        raise AdaptiveError(f"config.json {path!r}: {key} must be positive, got {value}")
    return value


def _name_from_path(path: Path) -> str:
    """`models/Mixtral-8x7B/config.json` and `models/Mixtral-8x7B` are both "Mixtral-8x7B"."""
    if path.is_dir() or path.stem == "config":
        folder = path if path.is_dir() else path.parent
        return folder.resolve().name or path.stem
    return path.stem


def spec_from_hf_config(path: str | Path, arch: str | None = None) -> ModelSpec:
    """A ModelSpec for an HF config. `arch` may turn a dense config into mod/hybrid/moe shapes."""
    cfg = read_config_json(path)
    p = str(path)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise unknown("model_type in config.json", str(model_type), SUPPORTED_TYPES)
    if model_type == "adaptive":
        spec = _spec_from_adaptive_config(cfg, p)
        # a dense export planned as our MoE/MoD/hybrid variant of it, like a dense HF config below
        return spec if arch in (None, spec.arch) or spec.is_moe or spec.is_mod else arch_variant(spec, arch)

    h = _field(cfg, "hidden_size", p)
    heads = _field(cfg, "num_attention_heads", p)
    kv = _field(cfg, "num_key_value_heads", p, default=heads)
    layers = _field(cfg, "num_hidden_layers", p)
    if not cfg.get("head_dim") and h % heads:
        raise AdaptiveError(f"config.json {p!r}: hidden_size ({h}) is not divisible by num_attention_heads ({heads}) "
                            "and no head_dim is given")
    head_dim = cfg.get("head_dim") or h // heads
    if head_dim % 2:
        raise AdaptiveError(f"config.json {p!r}: head_dim ({head_dim}) must be even; rotary embeddings rotate pairs")
    if heads % kv:
        raise AdaptiveError(f"config.json {p!r}: num_attention_heads ({heads}) must be divisible by num_key_value_heads ({kv})")
    name = cfg.get("_name_or_path") or _name_from_path(Path(p))
    common = dict(
        name=str(name) or model_type,
        vocab_size=_field(cfg, "vocab_size", p),
        hidden_size=h,
        intermediate_size=_field(cfg, "intermediate_size", p),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=cfg.get("max_position_embeddings") or 4096,
        rope_theta=float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        source=f"hf:{model_type}",
    )
    if model_type == "llama":
        bias = bool(cfg.get("attention_bias", False))
        common.update(qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))
    elif model_type in ("qwen2", "qwen2_moe"):
        common.update(qkv_bias=bool(cfg.get("qkv_bias", True)))

    if model_type == "mixtral":
        if arch not in (None, "moe"):
            raise AdaptiveError(f"--arch {arch} does not apply to {p!r}: a mixtral config is already moe")
        experts = _field(cfg, "num_local_experts", p, default=8)
        return ModelSpec(arch="moe", layer_types=("moe",) * layers, num_local_experts=experts,
                         num_experts_per_tok=_field(cfg, "num_experts_per_tok", p, default=2),
                         moe_intermediate_size=common["intermediate_size"], **common)
    if model_type == "qwen2_moe":
        if arch not in (None, "moe"):
            raise AdaptiveError(f"--arch {arch} does not apply to {p!r}: a qwen2_moe config is already moe")
        step = _field(cfg, "decoder_sparse_step", p, default=1)
        dense_only = set(cfg.get("mlp_only_layers") or [])
        types = tuple("moe" if (i + 1) % step == 0 and i not in dense_only else "dense" for i in range(layers))
        return ModelSpec(arch="moe", layer_types=types,
                         num_local_experts=_field(cfg, "num_experts", p, default=60),
                         num_experts_per_tok=_field(cfg, "num_experts_per_tok", p, default=4),
                         moe_intermediate_size=_field(cfg, "moe_intermediate_size", p, default=1408),
                         shared_expert_intermediate_size=_field(cfg, "shared_expert_intermediate_size", p,
                                                                default=5632),
                         **common)
    dense = ModelSpec(arch="dense", layer_types=("dense",) * layers, **common)
    return arch_variant(dense, arch or "dense")


def arch_variant(dense: ModelSpec, arch: str) -> ModelSpec:
    """A dense shape planned as our `arch` variant of it (MoE experts as wide as its FFN)."""
    if arch not in ARCHS:
        raise unknown("arch", arch, ARCHS)
    if arch == "dense":
        return dense
    moe = block_type(arch).has_experts
    return replace(dense, arch=arch, layer_types=layer_pattern(arch, dense.num_hidden_layers),
                   num_local_experts=DEFAULT_NUM_EXPERTS if moe else 0,
                   num_experts_per_tok=DEFAULT_TOP_K if moe else 0,
                   moe_intermediate_size=dense.intermediate_size if moe else 0,
                   mod_capacity=DEFAULT_MOD_CAPACITY if block_type(arch).routed else 1.0)


def _spec_from_adaptive_config(cfg: dict, path: str) -> ModelSpec:
    """Our own exported config.json: its fields are ModelSpec's fields."""
    fields = set(ModelSpec.__dataclass_fields__)
    data = {k: v for k, v in cfg.items() if k in fields}
    data["name"] = cfg.get("preset") or Path(path).parent.name or "adaptive"
    data.setdefault("arch", cfg.get("arch", "dense"))
    # our config stores the per-layer pattern as `block_types` (transformers reserves `layer_types`)
    data["layer_types"] = tuple(cfg.get("block_types") or ())
    data["source"] = "hf:adaptive"
    try:
        return ModelSpec(**data)
    except TypeError as e:
        raise AdaptiveError(f"config.json {path!r} is not a complete adaptive config: {e}") from None


def default_kernels(spec: ModelSpec) -> str:
    """"plain" for an HF config.json that transformers' own class trains (its Llama-style ops), else
    "lean" (adaptive's classes: presets, our exports, our MoE/MoD/hybrid variants of a dense shape)."""
    if not spec.source.startswith("hf:") or spec.source == "hf:adaptive":
        return "lean"
    return "plain" if spec.arch == "dense" or spec.source[3:] in MOE_TYPES else "lean"

