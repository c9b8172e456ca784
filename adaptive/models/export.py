"""Export to the model types the ecosystem loads: `llama` for dense models, `mixtral` for plain MoE models.

Serving stacks and tools (vLLM, llama.cpp converters, lm-evaluation-harness) know `llama` and `mixtral`, not
`adaptive`. A model is written as one of them only when that class computes the same function:

- `llama`: every block dense; q/k/v/o biases all on or all off (Llama has one `attention_bias`).
- `mixtral`: every block MoE, top-2, no biases; routing that Mixtral's router reproduces in inference
  (softmax, top-2, weights renormalised over the two, nothing dropped). That rules out a selection bias
  (the orchestrator's aux-loss-free balancing: Mixtral has no place for it), an eval capacity that drops
  tokens, Gumbel sampling of the second expert, and top-1 (DeepSpeed's top-1 weight is the gate
  probability; Mixtral renormalises it to 1).
- MoD and hybrid models, and anything above that is not representable, stay `adaptive`. Such an export
  carries its modeling code and `auto_map` (`write_remote_code`, below): it loads with
  `trust_remote_code=True` where adaptive is not installed.

`choose_format` says which format and why; `export_pretrained` writes it. Our native MoE layout is Mixtral's
(`gate.weight`, 3D `experts.gate_up_proj [E, 2I, H]` / `experts.down_proj [E, H, I]`), so the weights map
one to one; a DeepSpeed-MoE model is converted to that layout first.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path
from typing import NamedTuple

import torch

from adaptive.errors import AdaptiveError
from adaptive.models.configuration_adaptive import AdaptiveConfig
from adaptive.models.moe import from_deepspeed_layout

FORMATS = ("auto", "llama", "mixtral", "adaptive")

_BIAS = re.compile(r"^model\.layers\.\d+\.mlp\.(deepspeed_moe\.)?gate\.e_score_correction_bias$")


class ExportFormat(NamedTuple):
    format: str  # "llama" | "mixtral" | "adaptive"
    reason: str  # why this format (and, for "adaptive", why not a portable one)


def _llama_blockers(config: AdaptiveConfig) -> list[str]:
    out = []
    if any(t != "dense" for t in config.block_types):
        out.append(f"Llama has only dense blocks; this model has {sorted(set(config.block_types) - {'dense'})}")
    if config.qkv_bias != config.o_bias:
        out.append(f"Llama has one attention_bias; qkv_bias={config.qkv_bias} but o_bias={config.o_bias}")
    return out


def _mixtral_blockers(config: AdaptiveConfig, state_dict: dict | None) -> list[str]:
    out = []
    if any(t != "moe" for t in config.block_types):
        out.append(f"Mixtral has an MoE MLP in every block; block_types are {sorted(set(config.block_types))}")
    if config.qkv_bias or config.o_bias or config.mlp_bias:
        out.append("Mixtral has no attention or MLP biases")
    if config.moe_layers:
        if config.num_experts_per_tok != 2:
            out.append("top-1 routing weights each token by its gate probability; Mixtral renormalises it to 1")
        if config.eval_capacity_factor is not None and config.drop_tokens:
            out.append(f"eval_capacity_factor={config.eval_capacity_factor} drops tokens in inference; Mixtral never does")
        if config.top2_2nd_expert_sampling:
            out.append("top2_2nd_expert_sampling samples the second expert; Mixtral's router is deterministic")
    if state_dict is not None and any(_BIAS.match(k) and bool(v.abs().sum() > 0) for k, v in state_dict.items()):
        out.append("the expert selection bias (the orchestrator's aux-loss-free balancing) is in use; "
                   "it is not representable in Mixtral")
    return out


def choose_format(config: AdaptiveConfig, state_dict: dict | None = None, requested: str = "auto") -> ExportFormat:
    """The format to write: the most portable one that computes the same function, or the requested one.

    Raises AdaptiveError when `requested` is a portable format this model cannot be written as.
    """
    if requested not in FORMATS:
        raise AdaptiveError(f"export format must be one of {', '.join(FORMATS)}, got {requested!r}")
    llama, mixtral = _llama_blockers(config), _mixtral_blockers(config, state_dict)
    if requested == "llama" and llama:
        raise AdaptiveError(f"cannot export as llama: {llama[0]}")
    if requested == "mixtral" and mixtral:
        raise AdaptiveError(f"cannot export as mixtral: {mixtral[0]}")
    if requested == "adaptive":
        return ExportFormat("adaptive", "requested")
    if requested in ("llama", "mixtral"):
        return ExportFormat(requested, "requested")
    if not llama:
        return ExportFormat("llama", "dense model: loads as LlamaForCausalLM")
    if config.moe_layers and not config.mod_layers and not mixtral:
        return ExportFormat("mixtral", "MoE model without selection bias: loads as MixtralForCausalLM")
    why = mixtral if config.moe_layers and not config.mod_layers else llama
    if config.mod_layers:
        why = ["MoD routing has no equivalent in transformers' model classes"]
    return ExportFormat("adaptive", "; ".join(why))


def _common_fields(config: AdaptiveConfig) -> dict:
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, hidden_act=config.hidden_act, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps, rope_parameters=dict(config.rope_parameters),
        initializer_range=config.initializer_range, tie_word_embeddings=config.tie_word_embeddings,
        attention_dropout=config.attention_dropout, pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, dtype=config.dtype,
    )


def llama_config(config: AdaptiveConfig):
    from transformers import LlamaConfig

    return LlamaConfig(**_common_fields(config), intermediate_size=config.intermediate_size,
                       attention_bias=config.qkv_bias, mlp_bias=config.mlp_bias)


def mixtral_config(config: AdaptiveConfig):
    from transformers import MixtralConfig

    return MixtralConfig(**_common_fields(config), intermediate_size=config.moe_intermediate_size,
                         num_local_experts=config.num_local_experts, num_experts_per_tok=config.num_experts_per_tok,
                         router_aux_loss_coef=config.router_aux_loss_coef, sliding_window=None)


def mixtral_state_dict(state_dict: dict) -> dict:
    """Our state dict (either MoE layout) -> Mixtral's: our native layout is Mixtral's, less the selection bias."""
    return {k: v for k, v in from_deepspeed_layout(state_dict).items() if not _BIAS.match(k)}


def export_pretrained(model, target: str | Path, requested: str = "auto", state_dict: dict | None = None,
                      is_main_process: bool = True) -> ExportFormat:
    """Write `model` (an AdaptiveForCausalLM) to `target` in the most portable format (or `requested`).

    Under DeepSpeed expert parallelism the experts are gathered first: call it on every rank. `state_dict`
    is a full state dict gathered by the caller (ZeRO-3), else the model's own.
    """
    if state_dict is None:
        state_dict = model.global_state_dict()  # a collective under expert parallelism
    chosen = choose_format(model.config, state_dict, requested)
    if not is_main_process:
        return chosen
    if chosen.format == "adaptive":
        model.save_pretrained(target, state_dict=state_dict)
        write_remote_code(target)  # loads with trust_remote_code=True where adaptive is not installed
        return chosen
    from transformers import LlamaForCausalLM, MixtralForCausalLM

    if chosen.format == "llama":
        cls, config, weights = LlamaForCausalLM, llama_config(model.config), dict(state_dict)
    else:
        cls, config = MixtralForCausalLM, mixtral_config(model.config)
        weights = mixtral_state_dict(state_dict)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    with torch.device("meta"):
        portable = cls(config)
    # assign=True adopts our tensors without a copy; then the non-persistent buffers (RoPE) are rebuilt
    missing, unexpected = portable.load_state_dict(weights, strict=False, assign=True)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise AdaptiveError(f"export as {chosen.format}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if config.tie_word_embeddings:
        portable.tie_weights()
    portable.save_pretrained(target)
    return chosen


# ---------------------------------------------------------------------------------------------
# The modeling code an `adaptive`-format export carries, so that it loads without adaptive installed.
#
# transformers' convention for a model class it does not ship: config.json names the classes in `auto_map`
# ("file.Class"), the folder holds those files, and `AutoModelForCausalLM.from_pretrained(path,
# trust_remote_code=True)` imports them as a package of its own (transformers/dynamic_module_utils.py). That
# loader copies a file's *relative* imports (`from .x import y`, x.py beside it, one level) and checks that
# every absolute import of the named files is installed; an absolute `adaptive.*` import would fail there.
#
# `write_remote_code` writes the closure of `configuration_adaptive` and `modeling_adaptive` over their imports
# of `adaptive.*` modules (mod, moe, lean, grouped, and the pure plan modules they read: errors, record, block
# types, presets, losses), each as one flat file whose `from adaptive.<...>.x import` lines now read
# `from .x import`. They are copies of the running package's source, so an export loads with the code that
# wrote it. The package's own imports of DeepSpeed MoE go by name (`modeling_adaptive._moe_deepspeed`), which
# an export never reaches: its config says moe_implementation "native".

# the classes transformers' Auto classes find in an export's files (transformers' auto_map keys)
AUTO_MAP = {
    "AutoConfig": "configuration_adaptive.AdaptiveConfig",
    "AutoModel": "modeling_adaptive.AdaptiveModel",
    "AutoModelForCausalLM": "modeling_adaptive.AdaptiveForCausalLM",
}
_ENTRY = ("adaptive.models.configuration_adaptive", "adaptive.models.modeling_adaptive")
_FROM_ADAPTIVE = re.compile(r"^(\s*)from\s+(adaptive(?:\.\w+)*)\s+import\b")
_RELATIVE = re.compile(r"^\s*from\s+\.(\w+)\s+import", re.MULTILINE)  # as transformers' get_relative_imports


def _adaptive_imports(tree: ast.Module) -> list[ast.ImportFrom]:
    """Every `from adaptive... import` of a module, at any depth; `import adaptive...` is refused (it cannot be
    made relative in one flat folder)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "adaptive" for a in node.names):
            raise AssertionError(f"line {node.lineno}: `import adaptive...`; use `from adaptive.x import y`")
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "adaptive":
            if node.module == "adaptive":
                raise AssertionError(f"line {node.lineno}: `from adaptive import ...`; import from its module")
            found.append(node)
    return found


def code_files() -> dict[str, str]:
    """File name -> source, for every module the export's classes import: relative imports among themselves,
    nothing of adaptive's absolute."""
    sources: dict[str, str] = {}
    owner: dict[str, str] = {}  # flat file name -> the module it holds: two modules may not share a name
    todo = list(_ENTRY)
    while todo:
        module = todo.pop()
        name = module.rsplit(".", 1)[-1] + ".py"
        if owner.setdefault(name, module) != module:
            raise AssertionError(f"{module} and {owner[name]} would both be {name} in an export")
        if name in sources:
            continue
        source = Path(importlib.import_module(module).__file__).read_text(encoding="utf-8")
        lines = source.splitlines(keepends=True)
        for node in _adaptive_imports(ast.parse(source)):
            todo.append(node.module)
            line = lines[node.lineno - 1]
            match = _FROM_ADAPTIVE.match(line)
            if match is None or match.group(2) != node.module:
                raise AssertionError(f"{module} line {node.lineno}: the import of {node.module} is not on one line")
            lines[node.lineno - 1] = f"{match.group(1)}from .{node.module.rsplit('.', 1)[-1]} import" + \
                line[match.end():]
        sources[name] = "".join(lines)
    return dict(sorted(sources.items()))


def write_remote_code(folder: str | Path) -> list[str]:
    """Write the modeling files into `folder` (a saved adaptive model) and name its classes in config.json's
    `auto_map`. Returns the file names written."""
    folder = Path(folder)
    files = code_files()
    for name, source in files.items():
        (folder / name).write_text(source, encoding="utf-8")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["auto_map"] = dict(AUTO_MAP)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return list(files)


def has_remote_code(folder: str | Path) -> bool:
    """`folder`'s config names our classes in auto_map, and it holds their files and every file those import
    relatively (what transformers' loader copies)."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    auto_map = config.get("auto_map") or {}
    if any(auto_map.get(key) != value for key, value in AUTO_MAP.items()):
        return False
    todo, seen = [value.split(".")[0] for value in AUTO_MAP.values()], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            source = (folder / f"{name}.py").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return False
        todo += _RELATIVE.findall(source)
    return True


__all__ = ["AUTO_MAP", "FORMATS", "ExportFormat", "choose_format", "export_pretrained", "llama_config", "mixtral_config",
           "mixtral_state_dict",
           "code_files", "has_remote_code", "write_remote_code"]
