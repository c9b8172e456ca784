"""Checkpoints that survive a crash mid-write, resume that finds the newest complete one, and the
portable HF export.

Layout under `<output-dir>/checkpoints/`:

    step_00000040/                  one complete checkpoint
        pytorch_model/ ...          DeepSpeed engine state (accelerator.save_state: model, ZeRO
        latest                      optimizer partitions per rank, MoE expert files)
        scheduler.bin               LR schedule (accelerate)
        random_states_<rank>.pkl    RNG states per process (accelerate)
        trainer_state.json          step, tokens, each rank's data position, knobs in force, LR scale
        data_state_<rank>.json      each rank's data position and streaming loader state (JSON)
        COMPLETE.json               written last: every file above with its size and SHA-256
    latest                          the name of the newest complete checkpoint (text)
    .tmp-step_00000050/             a checkpoint being written (or left by a crash): never read

Atomicity: every rank writes into `.tmp-<name>`; each node's first process fsyncs the files; the
main process writes COMPLETE.json (fsynced), renames the folder to `<name>` (atomic on POSIX; a step
saved again is swapped in before the old one is deleted, `adaptive.durable.replace_dir`), fsyncs the
parent and replaces `latest` through write-temp + fsync + os.replace. A crash at any point leaves
either the previous checkpoint as `latest` or a `.tmp-` folder that resume ignores. Checkpoints
assume a filesystem all nodes share (as DeepSpeed's do).

Resume trusts nothing it reads: `latest` must name a step folder of this run; the checkpoint's files
must match COMPLETE.json's sizes and digests (else the next older one is tried, with a warning); and
every pickle is read by torch's weights-only unpickler, which builds tensors, plain containers and
the few DeepSpeed classes of `adaptive.engine.CHECKPOINT_CLASSES`, and runs nothing else.

The HF export (`export_hf`) writes safetensors + config + tokenizer that
`AutoModelForCausalLM.from_pretrained` loads without DeepSpeed: ZeRO-3 weights are consolidated by
DeepSpeed (stage3_gather_16bit_weights_on_model_save), expert-parallel experts are gathered first. By
default it picks the most portable format (`adaptive.models.export.choose_format`): `llama` for dense
models, `mixtral` for plain MoE models, else `adaptive` (loads after `import adaptive`). The choice and
its reason go into `adaptive_export.json`. `adaptive.train.run_folder.export.convert_export` rewrites an existing
export in another format (`adaptive export RUN_DIR --format ...`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

from accelerate.logging import get_logger

from adaptive.durable import atomic_write_text, fsync_tree, replace_dir
from adaptive.errors import AdaptiveError

logger = get_logger(__name__)
# finding a checkpoint also runs where accelerate's state does not exist (`adaptive launch --resume`)
lookup_logger = logging.getLogger(__name__)

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
# The manifest: sizes (a cheap completeness check) and SHA-256 digests (verified before a resume)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _manifest_files(folder: Path) -> dict[str, dict[str, Any]]:
    files = [p for p in sorted(folder.rglob("*")) if p.is_file()]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL
        digests = list(pool.map(_digest, files))
    return {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": d} for p, d in zip(files, digests)}


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        if not isinstance(files, dict) or not files:
            return None
        return {rel: entry if isinstance(entry, dict) else {"size": entry} for rel, entry in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def is_complete(folder: Path) -> bool:
    """COMPLETE.json exists, parses, and every file it lists exists with its recorded size."""
    files = _read_manifest(folder)
    try:
        return files is not None and all((Path(folder) / rel).is_file() and
                                         (Path(folder) / rel).stat().st_size == entry["size"]
                                         for rel, entry in files.items())
    except (OSError, KeyError, TypeError):
        return False


def verify(folder: Path) -> str | None:
    """Why `folder` cannot be resumed from (None: every file is there with its size and digest). A file
    inside must not point outside it: a link is refused."""
    folder = Path(folder)
    if not is_complete(folder):
        return f"incomplete ({MANIFEST} missing, or a file missing or of another size)"
    for rel, entry in _read_manifest(folder).items():
        path = folder / rel
        if path.is_symlink() or ".." in Path(rel).parts:
            return f"{rel} is a link or leaves the folder"
        if "sha256" in entry and _digest(path) != entry["sha256"]:
            return f"{rel} does not match its SHA-256 in {MANIFEST}"
    return None


# ---------------------------------------------------------------------------------------------
# Save


def save_checkpoint(accelerator: Any, output_dir: Path, step: int, trainer_state: dict[str, Any],
                    keep: int, rank_files: dict[str, str] | None = None, trained_only: bool = False) -> Path:
    """Save the full training state as `checkpoints/step_<step>`, atomically. All ranks call it; each writes
    its own `rank_files` (name: text) into the folder. `trained_only` (a LoRA run): the module states hold the
    parameters that train and not the frozen base, which --init-from rebuilds (DeepSpeed's
    exclude_frozen_parameters). A write that fails (a full or read-only disk) removes its partial folder and raises
    one line naming the newest complete checkpoint."""
    root = Path(output_dir) / CHECKPOINTS
    name = checkpoint_name(step)
    tmp, final = root / f".tmp-{name}", root / name
    started = time.perf_counter()
    try:
        if accelerator.is_main_process:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".tmp-*"):  # left by a crash; the run folder's lock allows one writer
                shutil.rmtree(stale, ignore_errors=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp), **({"exclude_frozen_parameters": True} if trained_only else {}))
        for file_name, text in (rank_files or {}).items():
            tmp.mkdir(parents=True, exist_ok=True)
            atomic_write_text(tmp / file_name, text)
        if accelerator.is_main_process:
            atomic_write_text(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=2) + "\n")
        accelerator.wait_for_everyone()
        if accelerator.is_local_main_process:
            fsync_tree(tmp)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            manifest = {"step": step, "time": time.time(), "files": _manifest_files(tmp)}
            atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=2) + "\n")
            replace_dir(tmp, final)  # the same step saved again (after a rollback) replaces the old one
            atomic_write_text(root / LATEST, name + "\n")
            prune_checkpoints(root, keep)
    except (OSError, RuntimeError) as err:  # torch.save's writer reports a full disk as a RuntimeError
        from adaptive.engine import collective_failure

        if collective_failure(err):  # another rank failed while this one wrote: the fault handler names it
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        newest = read_latest(root)
        reason = os_reason(err) if isinstance(err, OSError) else str(err).strip().splitlines()[-1][:200]
        raise AdaptiveError(f"checkpoint {final} could not be written ({reason}); the newest complete "
                            f"checkpoint is {newest if newest is not None else 'none'}: fix that and --resume") from None
    accelerator.wait_for_everyone()
    logger.info("checkpoint %s written in %.1f s", final, time.perf_counter() - started)
    return final


def os_reason(err: OSError) -> str:
    return f"{err.strerror or err}: {err.filename}" if err.filename else str(err.strerror or err)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root` (sizes checked, not digests), newest step first."""
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
    """The checkpoint `latest` names, inside `root`. None when it is missing or names anything but a step
    folder: a `latest` holding `../other_run/...`, or bytes that are not text, is never followed."""
    try:
        raw = (Path(root) / LATEST).read_bytes()
    except OSError:
        return None
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        name = ""
    if not _STEP_DIR.match(name):
        lookup_logger.warning("%s does not name a checkpoint of this folder (%r); ignoring it", Path(root) / LATEST,
                       raw[:40])
        return None
    return Path(root) / name


# ---------------------------------------------------------------------------------------------
# Resume


def find_checkpoint(resume: str, output_dir: Path, digests: bool = True) -> Path | None:
    """The checkpoint `--resume` means, verified (sizes and SHA-256 digests). "auto" (or a run folder, or a
    checkpoints folder) gives the one `latest` names, else the newest older one that verifies (any, when
    `latest` is unusable), with a warning for each one passed over; a step folder must verify. None when
    there is none. `digests=False` checks sizes only (a cheap look before the real resume verifies)."""
    check = verify if digests else (lambda folder: None if is_complete(folder) else "incomplete")
    if resume == "auto":
        target = Path(output_dir)
    else:
        target = Path(resume).expanduser()
        if not target.exists():
            raise AdaptiveError(f"--resume {resume!r} does not exist; "
                                "pass a run folder, its checkpoints/ or a step folder")
    if checkpoint_step(target) is not None:
        reason = check(target)
        if reason:
            raise AdaptiveError(f"checkpoint {str(target)!r} cannot be resumed: {reason}")
        return target
    root = target / CHECKPOINTS if (target / CHECKPOINTS).is_dir() else target
    latest = read_latest(root)
    candidates = [p for p in [latest] if p is not None and p.is_dir()]
    # past `latest`, only older ones: a newer one belongs to a history a resume abandoned
    newest = checkpoint_step(latest) if latest is not None else None
    candidates += [p for p in complete_checkpoints(root) if p not in candidates and
                   (newest is None or checkpoint_step(p) < newest)]
    for path in candidates:
        reason = check(path)
        if reason is None:
            return path
        lookup_logger.warning("checkpoint %s cannot be resumed (%s); trying an older one", path, reason)
    return None


def read_trainer_state(path: Path) -> dict[str, Any]:
    """A checkpoint's trainer_state.json, with the keys resume reads (one line when it is not usable)."""
    file = Path(path) / TRAINER_STATE
    try:
        saved = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise AdaptiveError(f"{file} is not readable JSON ({type(err).__name__}); resume from another checkpoint") \
            from None
    required = {"step": int, "tokens_seen": int, "skipped_steps": int, "lr_scale": (int, float), "samples_seen": list,
                "knobs": dict, "max_steps": int, "world_size": int}
    bad = [k for k, kind in required.items() if not isinstance(saved, dict) or not isinstance(saved.get(k), kind)]
    if bad:
        raise AdaptiveError(f"{file} lacks or mistypes {', '.join(bad)}; resume from another checkpoint")
    return saved


def data_state_file(rank: int) -> str:
    return f"data_state_{rank}.json"


def read_data_state(path: Path, rank: int, position: int) -> dict[str, Any] | None:
    """This rank's data state (JSON: position, loader workers, loader state), or None for a checkpoint that has
    none (written before loader states were saved: map-style data resume from trainer_state's position alone)."""
    file = Path(path) / data_state_file(rank)
    if not file.exists():
        return None
    try:
        saved = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise AdaptiveError(f"{file} is not readable JSON ({type(err).__name__}); resume from another checkpoint") \
            from None
    if not isinstance(saved, dict) or saved.get("position") != position or \
            not isinstance(saved.get("loader"), (dict, type(None))):
        raise AdaptiveError(f"{file} does not hold this rank's data state at sample {position} (trainer_state.json's); "
                            "resume from another checkpoint")
    return saved


def unsafe_pickles(path: Path) -> list[tuple[str, list[str]]]:
    """(file, classes) for each file of the checkpoint that pickles a class resume does not allow. Read
    statically: nothing is unpickled."""
    import torch

    from adaptive.engine import checkpoint_classes

    allowed = {f"{c.__module__}.{c.__qualname__}" for c in checkpoint_classes()}
    found = []
    for file in sorted(Path(path).rglob("*")):
        if file.is_file() and file.suffix in (".pt", ".bin", ".pkl", ".pth"):
            try:
                names = torch.serialization.get_unsafe_globals_in_checkpoint(str(file))
            except Exception as err:  # not a torch zip file: the weights-only loader would refuse it too
                names = [f"<not a torch file: {type(err).__name__}>"]
            extra = [n for n in names if n not in allowed]
            if extra:
                found.append((str(file.relative_to(path)), extra))
    return found


@contextmanager
def tensors_only() -> Iterator[None]:
    """Every torch.load inside runs torch's weights-only unpickler, DeepSpeed's and accelerate's included
    (they pass weights_only=False): tensors, plain containers and the allowed classes, nothing else."""
    import torch

    from adaptive.engine import checkpoint_classes

    old = os.environ.get(_FORCE_WEIGHTS_ONLY)
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(checkpoint_classes()):
            yield
    finally:
        if old is None:
            os.environ.pop(_FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[_FORCE_WEIGHTS_ONLY] = old


_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # read by torch.load at each call


def load_checkpoint(accelerator: Any, path: Path, trusted: bool = False, trained_only: bool = False) -> None:
    """Restore model, optimizer, scheduler and RNG states, unpickling tensors only. A file that pickles
    anything else is refused before any is loaded. `trusted` (--trust-checkpoint): DeepSpeed's own loading,
    the full unpickler. `trained_only`: the checkpoint holds the trained parameters alone (a LoRA run): every one
    of them must be in it (checked here; DeepSpeed loads it non-strict, the frozen base being absent)."""
    import pickle

    hint = "; if you wrote it yourself, --trust-checkpoint loads it with the full unpickler"
    unsafe = [] if trusted else unsafe_pickles(path)
    if unsafe:
        file, names = unsafe[0]
        raise AdaptiveError(f"checkpoint {path}: {file} pickles {', '.join(names[:3])}, which resume does not "
                            f"unpickle (a checkpoint holds tensors and DeepSpeed's training state only){hint}")
    if trained_only:
        missing = missing_trained_keys(accelerator, path)
        if missing:
            raise AdaptiveError(f"checkpoint {path} lacks {len(missing)} trained parameter(s) of this run, e.g. "
                                f"{missing[0]}: it was written by another fine-tune (other LoRA targets or rank?)")
    try:
        with nullcontext() if trusted else tensors_only():
            accelerator.load_state(str(path), **({"load_module_strict": False} if trained_only else {}))
    except pickle.UnpicklingError as err:
        raise AdaptiveError(f"checkpoint {path}: refused by the weights-only unpickler ("
                            f"{str(err).splitlines()[0][:200]}){hint}") from None
    except RuntimeError as err:  # e.g. shapes that differ: a checkpoint of another model
        raise AdaptiveError(f"checkpoint {path} does not load into this model: {str(err).splitlines()[0][:200]}") \
            from None


def missing_trained_keys(accelerator: Any, path: Path) -> list[str]:
    """The trained parameters of this run's model that the checkpoint's module states do not hold (ZeRO-0/1/2:
    DeepSpeed's mp_rank_00_model_states.pt; a ZeRO-3 checkpoint keeps them in its partitioned optimizer states,
    which DeepSpeed itself checks on load)."""
    import torch

    files = sorted(Path(path).glob("*/mp_rank_00_model_states.pt"))
    if not files:
        return []
    with tensors_only():
        module = torch.load(files[0], map_location="cpu", weights_only=True).get("module") or {}
    if not module:  # ZeRO-3 writes an empty module dict
        return []
    model = accelerator.unwrap_model(accelerator._models[0])
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    return [name for name in trained if name not in module]


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
    pipelined = hasattr(model, "set_checkpoint_policy")  # a pipeline stage (adaptive/models/pipeline.py)
    tensor_parallel = (accelerator.deepspeed_config.get("tensor_parallel") or {}).get("autotp_size", 0) > 1
    expert_parallel = config.ep_size > 1 and bool(config.moe_layers)
    if pipelined:
        # the stages' weights, gathered onto rank 0 under their HF names (a collective), into an HF model's shape
        from adaptive.models import AdaptiveForCausalLM
        from adaptive.models.pipeline import gather_hf_state_dict

        state_dict = gather_hf_state_dict(model)
        if main:
            chosen = export_pretrained(AdaptiveForCausalLM._from_config(config), tmp, export_format,
                                       state_dict=state_dict)
    elif tensor_parallel and expert_parallel:
        # DeepSpeed's TP gather fills rank 0's dict only, which holds rank 0's experts alone: gather the
        # TP shards on every rank, then the experts over the expert-parallel group (collectives)
        from adaptive.engine import tensor_parallel_state_dict
        from adaptive.models.moe_deepspeed import globalize_expert_state_dict

        state_dict = globalize_expert_state_dict(model, tensor_parallel_state_dict(model))
        if main:
            chosen = export_pretrained(model, tmp, export_format, state_dict=state_dict)
    elif accelerator.deepspeed_config["zero_optimization"]["stage"] == 3 or tensor_parallel:
        # DeepSpeed gathers the ZeRO-3 partitions and AutoTP shards onto rank 0 (a collective)
        state_dict = accelerator.get_state_dict(engine)
        if main:
            chosen = export_pretrained(model, tmp, export_format, state_dict=state_dict)
    elif expert_parallel:
        # gathers every rank's experts (a collective)
        chosen = export_pretrained(model, tmp, export_format, is_main_process=main)
    elif main:
        chosen = export_pretrained(model, tmp, export_format)
    if main:
        try:
            tokenizer.save_pretrained(tmp)
            metadata = {**metadata, "format": chosen.format, "format_reason": chosen.reason}
            (tmp / "adaptive_export.json").write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
            fsync_tree(tmp)
            replace_dir(tmp, target)
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise AdaptiveError(f"the HF export {target} could not be written ({os_reason(err)}); "
                                "the checkpoints hold the model: fix that and --resume") from None
    accelerator.wait_for_everyone()
    logger.info("HF model exported to %s", target)
    return target


__all__ = ["CHECKPOINTS", "LATEST", "MANIFEST", "TRAINER_STATE", "atomic_write_text", "checkpoint_name",
           "checkpoint_step", "complete_checkpoints", "data_state_file", "export_hf", "find_checkpoint", "fsync_tree",
           "is_complete", "load_checkpoint", "os_reason", "prune_checkpoints", "read_data_state", "read_latest",
           "read_trainer_state", "save_checkpoint", "tensors_only", "unsafe_pickles", "verify"]
