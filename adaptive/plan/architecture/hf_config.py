"""Read a transformers `config.json` into a ModelSpec: the decoders of families.py (Llama, Mistral, Qwen2, Qwen3,
Gemma 2, Gemma 3, Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE) and our own exports.

Pure JSON reading, so users can fit their own models offline without torch or transformers.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from adaptive.errors import AdaptiveError, unknown
from adaptive.plan.architecture.blocks import block_type
from adaptive.plan.architecture.families import FAMILIES, HF_TYPES
from adaptive.plan.architecture.hf_fields import EXPERT_KEYS, check_fields
from adaptive.plan.architecture.presets import (ARCHS, DEFAULT_MOD_CAPACITY, DEFAULT_NUM_EXPERTS, DEFAULT_TOP_K,
                                    ModelSpec, layer_pattern)

MOE_TYPES = tuple(t for t in HF_TYPES if FAMILIES[t].experts != "none")
DENSE_TYPES = tuple(t for t in HF_TYPES if t not in MOE_TYPES)
SUPPORTED_TYPES = HF_TYPES + ("adaptive",)


def looks_like_path(model: str) -> bool:
    return model.endswith(".json") or "/" in model or Path(model).is_dir()


def read_config_json(path: str | Path) -> dict:
    """The parsed JSON object of a config file (or of `config.json` inside a folder)."""
    import json  # only where a file is read: a preset's plan needs no json

    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise AdaptiveError(f"model config {str(path)!r} does not exist; give a preset name or a config.json path")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise AdaptiveError(f"malformed config.json {str(path)!r}: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (UnicodeDecodeError, OSError) as e:
        raise AdaptiveError(f"cannot read config.json {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise AdaptiveError(f"malformed config.json {str(path)!r}: expected a JSON object, got {type(data).__name__}")
    return data


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
        raise unknown_model_type(model_type)
    if model_type == "adaptive":
        spec = _spec_from_adaptive_config(cfg, p)
        # a dense export planned as our MoE/MoD/hybrid variant of it, like a dense HF config below
        return spec if arch in (None, spec.arch) or spec.is_moe or spec.is_mod else arch_variant(spec, arch)

    family = FAMILIES[model_type]
    f = check_fields(cfg, p)
    h, heads, layers = f.hidden_size, f.num_attention_heads, f.num_hidden_layers
    kv = f.num_key_value_heads or heads
    # config.json may leave head_dim out: Gemma's and Qwen3's config classes then say 256 and 128, not hidden / heads
    head_dim = f.head_dim or family.default_head_dim or h // heads
    if head_dim % 2:
        raise AdaptiveError(f"config.json {p!r}: head_dim ({head_dim}) must be even; rotary embeddings rotate pairs")
    rope = f.rope_parameters.rope_theta if f.rope_parameters and f.rope_parameters.rope_theta else f.rope_theta
    tie = f.tie_word_embeddings if "tie_word_embeddings" in cfg else family.default_tie
    if family.qkv_bias is None:  # configurable: `attention_bias` (Qwen2-MoE: `qkv_bias`, true by default)
        qkv_bias = bool(getattr(f, family.default_qkv_bias_key) if family.default_qkv_bias_key in cfg
                        else family.default_qkv_bias_key == "qkv_bias")
    else:
        qkv_bias = family.qkv_bias
    common = dict(
        name=f.name_or_path or _name_from_path(Path(p)) or model_type,
        vocab_size=f.vocab_size,
        hidden_size=h,
        intermediate_size=f.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=f.max_position_embeddings or 4096,
        rope_theta=float(rope or 10000.0),
        tie_word_embeddings=tie,
        qkv_bias=qkv_bias,
        o_bias=qkv_bias if family.o_bias_from_attention_bias else False,
        mlp_bias=f.mlp_bias if model_type == "llama" else False,
        attn_logit_softcapping=f.attn_logit_softcapping if model_type == "gemma2" else None,
        final_logit_softcapping=f.final_logit_softcapping if model_type in ("gemma2", "gemma3_text") else None,
        source=f"hf:{model_type}",
    )
    if model_type == "gemma2" and "attn_logit_softcapping" not in cfg:  # Gemma2Config's defaults
        common["attn_logit_softcapping"] = 50.0
    if model_type == "gemma2" and "final_logit_softcapping" not in cfg:
        common["final_logit_softcapping"] = 30.0

    if model_type in MOE_TYPES:
        if arch not in (None, "moe"):
            raise AdaptiveError(f"--arch {arch} does not apply to {p!r}: a {model_type} config is already moe")
        key, experts, top_k = EXPERT_KEYS[model_type]
        experts, top_k = getattr(f, key) or experts, f.num_experts_per_tok or top_k
    if model_type == "mixtral":
        return ModelSpec(arch="moe", layer_types=("moe",) * layers, num_local_experts=experts, num_experts_per_tok=top_k,
                         moe_intermediate_size=common["intermediate_size"], **common)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        step = f.decoder_sparse_step or 1
        dense_only = set(f.mlp_only_layers or [])
        types = tuple("moe" if (i + 1) % step == 0 and i not in dense_only else "dense" for i in range(layers))
        shared = (f.shared_expert_intermediate_size or 5632) if model_type == "qwen2_moe" else 0
        return ModelSpec(arch="moe", layer_types=types, num_local_experts=experts, num_experts_per_tok=top_k,
                         moe_intermediate_size=f.moe_intermediate_size or (1408 if model_type == "qwen2_moe" else 768),
                         shared_expert_intermediate_size=shared, **common)
    dense = ModelSpec(arch="dense", layer_types=("dense",) * layers, **common)
    return arch_variant(dense, arch or "dense")


def unknown_model_type(model_type: object) -> AdaptiveError:
    """One line naming the model_type and the ones we plan."""
    from adaptive.errors import closest

    near = closest(str(model_type), SUPPORTED_TYPES)
    hint = f"; did you mean {near}?" if near else ""
    return AdaptiveError(f"unsupported model_type {model_type!r} in config.json{hint} (supported: "
                         f"{', '.join(SUPPORTED_TYPES)})")


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
    """Our own exported config.json: its fields are ModelSpec's fields (checked like an HF config's)."""
    f = check_fields(cfg, path)
    arch = f.arch or "dense"
    if arch not in ARCHS:
        raise unknown(f"arch in config.json {path!r}:", arch, ARCHS)
    # our config stores the per-layer pattern as `block_types` (transformers reserves `layer_types`)
    types = tuple(f.block_types or ("dense",) * f.num_hidden_layers)
    for t in types:
        block_type(t)  # an unknown name is a one-line error naming the valid ones
    rope = f.rope_parameters.rope_theta if f.rope_parameters and f.rope_parameters.rope_theta else f.rope_theta
    return ModelSpec(
        name=f.preset or Path(path).parent.name or "adaptive", arch=arch, vocab_size=f.vocab_size,
        hidden_size=f.hidden_size, intermediate_size=f.intermediate_size, num_hidden_layers=f.num_hidden_layers,
        num_attention_heads=f.num_attention_heads, num_key_value_heads=f.num_key_value_heads or f.num_attention_heads,
        head_dim=f.head_dim or f.hidden_size // f.num_attention_heads, layer_types=types,
        max_position_embeddings=f.max_position_embeddings or 4096, rope_theta=float(rope or 10000.0),
        tie_word_embeddings=f.tie_word_embeddings, qkv_bias=bool(f.qkv_bias), o_bias=f.o_bias, mlp_bias=f.mlp_bias,
        num_local_experts=f.num_local_experts, num_experts_per_tok=f.num_experts_per_tok,
        moe_intermediate_size=f.moe_intermediate_size, shared_expert_intermediate_size=f.shared_expert_intermediate_size or 0,
        mod_capacity=float(f.mod_capacity), mod_predictor_hidden_size=f.mod_predictor_hidden_size, source="hf:adaptive")


def default_kernels(spec: ModelSpec) -> str:
    """"plain" for an HF config.json that transformers' own class trains (its Llama-style ops), else
    "lean" (adaptive's classes: presets, our exports, our MoE/MoD/hybrid variants of a dense shape)."""
    if not spec.source.startswith("hf:") or spec.source == "hf:adaptive":
        return "lean"
    return "plain" if spec.arch == "dense" or spec.source[3:] in MOE_TYPES else "lean"



def adaptive_config_dict(spec: ModelSpec) -> dict:
    """`spec` as our own config.json (model_type "adaptive"): what `--model PATH/config.json` plans and trains, the
    fields AdaptiveConfig.from_spec sets."""
    return {"model_type": "adaptive", "architectures": ["AdaptiveForCausalLM"], "preset": spec.name,
            "arch": spec.arch, "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
            "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_hidden_layers,
            "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_key_value_heads,
            "head_dim": spec.head_dim, "block_types": list(spec.layer_types),
            "max_position_embeddings": spec.max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
            "tie_word_embeddings": spec.tie_word_embeddings, "qkv_bias": spec.qkv_bias, "o_bias": spec.o_bias,
            "mlp_bias": spec.mlp_bias, "num_local_experts": spec.num_local_experts,
            "num_experts_per_tok": spec.num_experts_per_tok, "moe_intermediate_size": spec.moe_intermediate_size,
            "mod_capacity": spec.mod_capacity, "mod_predictor_hidden_size": spec.mod_predictor_hidden_size}
