"""Checkpoints that survive a crash mid-write, resume that finds the newest complete one, and the
portable HF export.

Layout under `<output-dir>/checkpoints/`:

    step_00000040/                  one complete checkpoint
        pytorch_model/ ...          DeepSpeed engine state (accelerator.save_state: model, ZeRO
        latest                      optimizer partitions per rank, MoE expert files)
        scheduler.bin               LR schedule (accelerate)
        random_states_<rank>.pkl    RNG states per process (accelerate)
        trainer_state.json          step, tokens, each rank's data position, knobs in force, LR scale
        COMPLETE.json               written last: every file above with its size
    latest                          the name of the newest complete checkpoint (text)
    .tmp-step_00000050/             a checkpoint being written (or left by a crash): never read

Atomicity: every rank writes into `.tmp-<name>`; each node's first process fsyncs the files; the
main process writes COMPLETE.json (fsynced), renames the folder to `<name>` (atomic on POSIX),
fsyncs the parent and replaces `latest` through write-temp + fsync + os.replace. A crash at any
point leaves either the previous checkpoint as `latest` or a `.tmp-` folder that resume ignores.
Resume verifies COMPLETE.json (files present, sizes equal) and falls back to the newest older
checkpoint that verifies. Checkpoints assume a filesystem all nodes share (as DeepSpeed's do).

The HF export (`export_hf`) writes safetensors + config + tokenizer that
`AutoModelForCausalLM.from_pretrained` loads without DeepSpeed: ZeRO-3 weights are consolidated by
DeepSpeed (stage3_gather_16bit_weights_on_model_save), expert-parallel experts are gathered first. By
default it picks the most portable format (`adaptive.models.export.choose_format`): `llama` for dense
models, `mixtral` for plain MoE models, else `adaptive` (loads after `import adaptive`). The choice and
its reason go into `adaptive_export.json`. `adaptive.train.export.convert_export` rewrites an existing
export in another format (`adaptive export RUN_DIR --format ...`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from accelerate.logging import get_logger

from adaptive.errors import AdaptiveError

logger = get_logger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "COMPLETE.json"
TRAINER_STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_step(path: Path) -> int | None:
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


# ---------------------------------------------------------------------------------------------
# Durable writes


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root`, then `root` itself."""
    for folder, _, files in os.walk(root):
        for name in files:
            _fsync_path(Path(folder) / name)
        _fsync_path(Path(folder))


def atomic_write_text(path: Path, text: str) -> None:
    """Write-temp, fsync, os.replace, fsync the folder: readers see the old or the new file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _file_sizes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def is_complete(folder: Path) -> bool:
    """COMPLETE.json exists, parses, and every file it lists exists with its recorded size."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        return bool(files) and all((Path(folder) / rel).is_file() and (Path(folder) / rel).stat().st_size == size
                                   for rel, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


# ---------------------------------------------------------------------------------------------
# Save


def save_checkpoint(accelerator: Any, output_dir: Path, step: int, trainer_state: dict[str, Any],
                    keep: int) -> Path:
    """Save the full training state as `checkpoints/step_<step>`, atomically. All ranks call it."""
    root = Path(output_dir) / CHECKPOINTS
    name = checkpoint_name(step)
    tmp, final = root / f".tmp-{name}", root / name
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):  # left by a crash; only one save runs at a time
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    started = time.perf_counter()
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        atomic_write_text(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=2) + "\n")
    accelerator.wait_for_everyone()
    if accelerator.is_local_main_process:
        fsync_tree(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        manifest = {"step": step, "time": time.time(), "files": _file_sizes(tmp)}
        atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        if final.exists():  # the same step saved again (after a rollback): replace it
            trash = root / f".tmp-old-{name}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, final)
        _fsync_path(root)
        atomic_write_text(root / LATEST, name + "\n")
        prune_checkpoints(root, keep)
    accelerator.wait_for_everyone()
    logger.info("checkpoint %s written in %.1f s", final, time.perf_counter() - started)
    return final


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, newest step first."""
    found = [p for p in Path(root).iterdir() if p.is_dir() and checkpoint_step(p) is not None] \
        if Path(root).is_dir() else []
    return [p for p in sorted(found, key=checkpoint_step, reverse=True) if is_complete(p)]


def prune_checkpoints(root: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints (never the one `latest` names)."""
    if keep < 1:
        return
    latest = read_latest(root)
    for old in complete_checkpoints(root)[keep:]:
        if latest is None or old.name != latest.name:
            shutil.rmtree(old, ignore_errors=True)


def read_latest(root: Path) -> Path | None:
    try:
        name = (Path(root) / LATEST).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return Path(root) / name if name else None


# ---------------------------------------------------------------------------------------------
# Resume


def find_checkpoint(resume: str, output_dir: Path) -> Path | None:
    """The checkpoint `--resume` means: "auto" (or a run folder, or a checkpoints folder) gives the
    newest complete checkpoint in it, falling back past incomplete ones; a step folder must be
    complete. None when there is none."""
    if resume == "auto":
        target = Path(output_dir)
    else:
        target = Path(resume).expanduser()
        if not target.exists():
            raise AdaptiveError(f"--resume {resume!r} does not exist; "
                                "pass a run folder, its checkpoints/ or a step folder")
    if checkpoint_step(target) is not None:
        if not is_complete(target):
            raise AdaptiveError(f"checkpoint {str(target)!r} is incomplete ({MANIFEST} missing or files differ)")
        return target
    root = target / CHECKPOINTS if (target / CHECKPOINTS).is_dir() else target
    latest = read_latest(root)
    if latest is not None and is_complete(latest):
        return latest
    candidates = complete_checkpoints(root)
    if latest is not None:
        fallback = candidates[0].name if candidates else "none"
        logger.warning("checkpoint %s named by %s is incomplete; using %s", latest, root / LATEST, fallback)
    return candidates[0] if candidates else None


def load_checkpoint(accelerator: Any, path: Path) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and RNG states; return the saved trainer state."""
    accelerator.load_state(str(path))
    return json.loads((Path(path) / TRAINER_STATE).read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------
# HF export


def export_hf(accelerator: Any, engine: Any, tokenizer: Any, target: Path, metadata: dict[str, Any],
              export_format: str = "auto") -> Path:
    """Write an HF model folder (safetensors, config, tokenizer) to `target`, atomically. All ranks call it.

    `export_format`: "auto" (the most portable format the model allows), "llama", "mixtral" or "adaptive".
    """
    from adaptive.models.export import export_pretrained

    target = Path(target)
    tmp = target.with_name(f".{target.name}.tmp")
    main = accelerator.is_main_process
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    model = accelerator.unwrap_model(engine)
    config = model.config
    chosen = None
    if accelerator.deepspeed_config["zero_optimization"]["stage"] == 3:
        # DeepSpeed gathers the partitioned 16-bit weights onto rank 0 (a collective)
        state_dict = accelerator.get_state_dict(engine)
        if main:
            chosen = export_pretrained(model, tmp, export_format, state_dict=state_dict)
    elif config.ep_size > 1 and config.moe_layers:
        # gathers every rank's experts (a collective)
        chosen = export_pretrained(model, tmp, export_format, is_main_process=main)
    elif main:
        chosen = export_pretrained(model, tmp, export_format)
    if main:
        tokenizer.save_pretrained(tmp)
        metadata = {**metadata, "format": chosen.format, "format_reason": chosen.reason}
        (tmp / "adaptive_export.json").write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
        fsync_tree(tmp)
        if target.exists():
            old = target.with_name(f".{target.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(target, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, target)
        _fsync_path(target.parent)
    accelerator.wait_for_everyone()
    logger.info("HF model exported to %s", target)
    return target


__all__ = ["CHECKPOINTS", "LATEST", "MANIFEST", "TRAINER_STATE", "atomic_write_text", "checkpoint_name",
           "checkpoint_step", "complete_checkpoints", "export_hf", "find_checkpoint", "fsync_tree", "is_complete",
           "load_checkpoint", "prune_checkpoints", "read_latest", "save_checkpoint"]
