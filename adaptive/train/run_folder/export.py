"""Convert a finished run's HF export to another format (`adaptive export RUN_DIR --format ...`).

Kept apart from `checkpoint.py`: it needs no accelerate or DeepSpeed (importing them prints and costs
seconds), only the model classes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from adaptive.durable import fsync_tree, replace_dir, temporary_name
from adaptive.models.export import ExportFormat

FINAL_EXPORT = "hf"  # the folder of a run's final export (adaptive.train.run.loop writes it)
PORTABLE = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}  # what a run's export may already be


def convert_export(source: Path, export_format: str = "auto", out: Path | None = None,
                   force: bool = False) -> tuple[Path, ExportFormat, bool]:
    """Rewrite an HF export (a run dir's `hf/` folder, or a model folder: adaptive, llama or mixtral) in
    `export_format`. A fine-tune's export of another transformers family (qwen3, gemma2, ...) is its own class:
    nothing is converted (`_own_class`).

    Writes `out` (default: `<source>-<format>` beside it) with the tokenizer files and `adaptive_export.json`
    carried over; returns the folder, the `ExportFormat` chosen and True. When the asked-for export exists
    already, nothing is written and the folder that holds it, its format and False come back:
    - the source is in that format (a llama or mixtral export, or an adaptive one that carries its modeling
      code), so it is the export;
    - the target holds this format's conversion of the same source files (`adaptive_export.json` records their
      names, sizes and modification times): a newer export of the run (another step) is converted again.
    `force` writes it anyway.
    """
    from adaptive.errors import AdaptiveError
    from adaptive.models import AdaptiveConfig
    from adaptive.models.export import choose_format, export_pretrained, has_remote_code

    source = Path(source)
    if (source / FINAL_EXPORT / "config.json").exists():
        source = source / FINAL_EXPORT
    if not (source / "config.json").exists():
        raise AdaptiveError(f"no HF export in {str(source)!r}: expected config.json there or in its hf/ folder")
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    model_type = config.get("model_type")
    if model_type in PORTABLE and export_format in ("auto", model_type) and not force:
        return source, ExportFormat(model_type, f"already {model_type}: it loads as {PORTABLE[model_type]} "
                                                f"as it is; nothing to export"), False
    if model_type not in ("adaptive", *PORTABLE):
        return source, _own_class(source, model_type, export_format), False
    model = None
    if model_type == "adaptive":  # the config alone decides, unless Mixtral is possible: the selection bias may not
        chosen = choose_format(AdaptiveConfig.from_pretrained(source), None, export_format)
    if model_type != "adaptive" or chosen.format == "mixtral":
        model = _load(source, model_type)
        chosen = choose_format(model.config, model.state_dict(), export_format)
    target = Path(out) if out is not None else source.with_name(f"{source.name}-{chosen.format}")
    meta_path = source / "adaptive_export.json"
    meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.exists() else {}
    fingerprint = source_fingerprint(source)
    if not force:
        existing = source if model_type == chosen.format == "adaptive" and has_remote_code(source) else \
            target if _converted(target, chosen.format, fingerprint) else None
        if existing is not None:
            which = f"step {meta['step']}'s export" if isinstance(meta.get("step"), int) else "this export"
            return existing, ExportFormat(chosen.format, f"already holds {which} ({chosen.format} format); "
                                                         "nothing to do (--force rewrites it)"), False
    if target.resolve() == source.resolve():
        raise AdaptiveError(f"--out {str(target)!r} is the source folder; pick another")
    if target.exists() and not (target / "adaptive_export.json").is_file():  # replaced whole below: never a stranger
        raise AdaptiveError(f"--out {str(target)!r} exists and is not an adaptive export; choose a new folder")
    if model is None:
        model = _load(source, model_type)
    tmp = temporary_name(target)  # written beside, then swapped in whole: an old `target` survives a failure
    try:
        export_pretrained(model, tmp, chosen.format)
        skip = {"config.json", "generation_config.json", "adaptive_export.json"}
        for file in source.iterdir():  # the tokenizer's files and the like; the export wrote its weights and code
            if file.is_file() and file.name not in skip and not file.name.endswith((".safetensors", ".json.index",
                                                                                    ".py")) \
                    and not file.name.startswith("model"):
                shutil.copy2(file, tmp / file.name)
        meta.update(format=chosen.format, format_reason=chosen.reason, converted_from=str(source),
                    source_fingerprint=fingerprint)
        (tmp / "adaptive_export.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        fsync_tree(tmp)
        replace_dir(tmp, target)
    except OSError as err:
        raise AdaptiveError(f"cannot write the export to {str(target)!r}: {err.strerror or err}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target, chosen, True


def _own_class(source: Path, model_type: str | None, export_format: str) -> ExportFormat:
    """A fine-tune of another transformers family (Qwen3, Gemma 2, Phi-3, Mistral, ...): its hf/ export is that
    family's own class, which AutoModelForCausalLM loads as it is, so there is nothing to convert (a Llama or
    Mixtral fine-tune is the `PORTABLE` case above). A format asked for by name cannot apply: one line."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from adaptive.errors import AdaptiveError
    from adaptive.models.export import FORMATS

    cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) if isinstance(model_type, str) else None
    if cls is None:
        raise AdaptiveError(f"{str(source)!r} holds a {model_type!r} model, which transformers' AutoModelForCausalLM "
                            "does not know; adaptive export reads adaptive, llama and mixtral exports and transformers' "
                            "own causal-LM families")
    if export_format not in FORMATS:
        raise AdaptiveError(f"export format must be one of {', '.join(FORMATS)}, got {export_format!r}")
    if export_format != "auto":
        raise AdaptiveError(f"cannot export as {export_format}: {str(source)!r} holds transformers' own {model_type} "
                            f"model ({cls}), which converts to no other format; it loads with AutoModelForCausalLM as "
                            "it is (--format auto: nothing to convert)")
    return ExportFormat(model_type, f"already {model_type}: transformers' own {cls}, loadable by AutoModelForCausalLM "
                                    "as it is; nothing to convert")


def source_fingerprint(source: Path) -> str:
    """The identity of an export's files: a digest of their names, sizes and modification times (reading the
    weights would cost what converting them does). A new export of the run, or any edit, changes it."""
    entries = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in Path(source).iterdir()
                     if f.is_file() and f.name != "adaptive_export.json")
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def _converted(target: Path, export_format: str, fingerprint: str) -> bool:
    """`target` holds the `export_format` conversion of the source files `fingerprint` names, with its weights."""
    try:
        meta = json.loads((target / "adaptive_export.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == export_format and \
        meta.get("source_fingerprint") == fingerprint and (target / "config.json").is_file() and \
        any(target.glob("*.safetensors"))


def _load(source: Path, model_type: str):
    """Our model from an adaptive folder, or from a llama/mixtral one through `--init-from`'s mapping (exact:
    those exports were written from our models)."""
    from adaptive.models import AdaptiveForCausalLM

    if model_type == "adaptive":
        return AdaptiveForCausalLM.from_pretrained(source)
    from adaptive.plan.architecture.hf_config import spec_from_hf_config
    from adaptive.train.run_folder.init_from import load_init_weights, source_arch, target_config

    arch = source_arch({"model_type": model_type})
    model = AdaptiveForCausalLM(target_config(str(source), spec_from_hf_config(source, arch)))
    load_init_weights(model, str(source))
    return model.eval()


__all__ = ["FINAL_EXPORT", "convert_export", "source_fingerprint"]
