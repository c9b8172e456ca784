"""`--init-from PATH`: check a checkpoint folder, plan its shape, read its weights and load them into the run's model.

The mapping onto our names (and sparse upcycling) is `adaptive.models.init_from`; this module does the I/O. The
checks that planning needs (`planned_model`) read only config.json and file names, so `--dry-run` stays torch-free.
Weights are loaded before `accelerator.prepare`: under ZeRO-3 the model was built partitioned (`zero.Init`), so each
parameter is gathered, written on rank 0 and partitioned again; under expert parallelism each rank keeps its own
experts (`load_global_state_dict`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from adaptive.errors import AdaptiveError
from adaptive.plan.architecture.hf_config import read_config_json

logger = logging.getLogger(__name__)

# what our own classes load (adaptive/models/init_from.py maps their names); the other transformers families of
# plan/architecture/families.py are planned, not loaded into our classes
SOURCE_TYPES = ("llama", "mistral", "qwen2", "mixtral", "adaptive")
# the single-file names first; a sharded checkpoint has an index naming its shards
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _where(path: str | Path) -> str:
    return f"--init-from {str(path)!r}"


def source_arch(cfg: dict) -> str:
    """What the checkpoint is: "dense" (Llama, Mistral, Qwen2, a dense adaptive export), "moe" (Mixtral) or an
    adaptive export's own arch."""
    if cfg.get("model_type") == "mixtral":
        return "moe"
    if cfg.get("model_type") != "adaptive":
        return "dense"
    types = set(cfg.get("block_types") or ["dense"])
    return "dense" if types == {"dense"} else str(cfg.get("arch") or "custom")


def check_source(path: str | Path, arch: str) -> dict:
    """config.json of the folder at `path` after checking it can start an `arch` model; AdaptiveError (one line) if not."""
    where, folder = _where(path), Path(path).expanduser()
    if not folder.is_dir():
        raise AdaptiveError(f"{where} is not a folder; give one with config.json and the weights (an HF export)")
    if not (folder / "config.json").is_file():
        raise AdaptiveError(f"{where} has no config.json")
    try:
        cfg = read_config_json(folder)
    except AdaptiveError as err:
        raise AdaptiveError(f"{where}: {err}") from None
    model_type = cfg.get("model_type")
    if model_type == "qwen2_moe":
        raise AdaptiveError(f"{where}: Qwen2-MoE's shared expert (with its sigmoid gate) and its unnormalised top-k "
                            "weights have no equivalent in adaptive's MoE, so it cannot be loaded exactly")
    if model_type not in SOURCE_TYPES:
        raise AdaptiveError(f"{where}: model_type {model_type!r} is not supported; start from one of "
                            f"{', '.join(SOURCE_TYPES)}")
    if model_type == "mixtral" and cfg.get("num_experts_per_tok", 2) != 2:
        raise AdaptiveError(f"{where}: Mixtral with top-{cfg.get('num_experts_per_tok')} routing cannot be loaded "
                            "exactly; adaptive's MoE matches Mixtral's routing at top-2")
    source = source_arch(cfg)
    if source != "dense" and source != arch:
        raise AdaptiveError(f"{where} holds a {source} model, which starts only a {source} one (not {arch}); train "
                            f"it with --arch {source} or a {source} recipe")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise AdaptiveError(f"{where} holds no weights: expected one of {', '.join(WEIGHT_FILES)}")
    return cfg


def planned_model(init_from: str | None, preset: str, arch: str, finetune: str | None = None) -> str:
    """What the planner sizes: the checkpoint's config.json (checked), else the preset. A fine-tune trains
    transformers' own class of any family the planner knows (check_finetune_source), not ours."""
    if init_from is None:
        return preset
    if finetune:
        check_finetune_source(init_from)
    else:
        check_source(init_from, arch)
    return str(Path(init_from).expanduser())


def check_finetune_source(path: str | Path) -> dict:
    """config.json of a checkpoint folder a fine-tune can start from: any family of plan/architecture/families.py
    (transformers' class trains it) or an adaptive export; AdaptiveError (one line) if not."""
    from adaptive.plan.architecture.hf_config import SUPPORTED_TYPES, unknown_model_type

    where, folder = _where(path), Path(path).expanduser()
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise AdaptiveError(f"{where} is not a folder with a config.json; give the checkpoint you downloaded")
    try:
        cfg = read_config_json(folder)
    except AdaptiveError as err:
        raise AdaptiveError(f"{where}: {err}") from None
    if cfg.get("model_type") not in SUPPORTED_TYPES:
        raise AdaptiveError(f"{where}: {unknown_model_type(cfg.get('model_type'))}")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise AdaptiveError(f"{where} holds no weights: expected one of {', '.join(WEIGHT_FILES)}")
    return cfg


def tokenizer_folder(init_from: str | None) -> str | None:
    """The checkpoint folder when it holds a tokenizer (it was trained with that one), else None."""
    if init_from and any((Path(init_from).expanduser() / name).is_file() for name in TOKENIZER_FILES):
        return str(Path(init_from).expanduser())
    return None


def read_state_dict(path: str | Path) -> dict[str, Any]:
    """Every tensor of the folder's weights (safetensors, or pytorch_model.bin read with weights_only), sharded or not."""
    import torch
    from safetensors.torch import load_file

    folder = Path(path).expanduser()
    name = next(n for n in WEIGHT_FILES if (folder / n).is_file())
    files = [folder / name]
    if name.endswith(".index.json"):
        try:
            weight_map = json.loads(files[0].read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise AdaptiveError(f"{_where(path)}: {name} is not a shard index ({type(err).__name__}: {err})") from None
        files = [folder / shard for shard in sorted(set(weight_map.values()))]
    state: dict[str, Any] = {}
    for file in files:
        try:
            if file.suffix == ".safetensors":
                state.update(load_file(file))
            else:
                state.update(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
        except Exception as err:  # a missing shard, a truncated file, a pickle that is more than tensors
            raise AdaptiveError(f"{_where(path)}: cannot read {file.name}: {str(err).splitlines()[0]}") from None
    return state


def target_config(init_from: str, spec: Any, **overrides) -> Any:
    """Our config for the plan's `spec` of the checkpoint, with its numerics (norm eps, RoPE, activation)."""
    from transformers import AutoConfig

    from adaptive.models.init_from import adaptive_config

    hf = AutoConfig.from_pretrained(str(Path(init_from).expanduser())).to_dict()  # standardises old RoPE fields
    return adaptive_config(hf, spec, **overrides)


def load_init_weights(model: Any, init_from: str) -> None:
    """Fill `model` (built from `target_config`, not yet prepared) with the checkpoint's weights."""
    import torch

    from adaptive.models.init_from import check_against, require_finite, to_native

    where = _where(init_from)
    state = read_state_dict(init_from)
    require_finite(state, where)
    mapped = to_native(state, model.config)
    check_against(mapped, model.config, where)
    if any(hasattr(p, "ds_id") for p in model.parameters()):  # ZeRO-3: built partitioned
        _load_partitioned(model, mapped.state_dict)
    else:
        with torch.no_grad():
            model.load_global_state_dict(mapped.state_dict, strict=False)
    kinds = sorted(set(model.config.block_types))
    logger.info("--init-from %s: %d tensors loaded into %s blocks%s%s", init_from, len(mapped.state_dict),
                "/".join(kinds), f"; layers {list(mapped.upcycled)} upcycled (experts = the dense FFN)"
                if mapped.upcycled else "", "; routers start fresh" if mapped.fresh else "")


def _load_partitioned(model: Any, state: dict[str, Any]) -> None:
    """Write each ZeRO-3 partitioned parameter whole on rank 0; leaving the context partitions it again."""
    import deepspeed
    import torch
    import torch.distributed as dist

    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    writer = not dist.is_initialized() or dist.get_rank() == 0
    with torch.no_grad():
        for key, value in state.items():
            if key in buffers:
                buffers[key].copy_(value)
                continue
            with deepspeed.zero.GatheredParameters([params[key]], modifier_rank=0):
                if writer:
                    params[key].copy_(value)


__all__ = ["SOURCE_TYPES", "TOKENIZER_FILES", "WEIGHT_FILES", "check_source", "load_init_weights", "planned_model",
           "read_state_dict", "source_arch", "target_config", "tokenizer_folder"]
