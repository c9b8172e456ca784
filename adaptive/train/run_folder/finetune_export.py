"""What a fine-tune hands back: `adapter/` (PEFT's save_pretrained: `PeftModel.from_pretrained(base, adapter)`
loads it) and `hf/` (the merged model, loadable by AutoModelForCausalLM, with the tokenizer and its chat template).

A LoRA or QLoRA run's merged model is the base checkpoint reloaded in 16 bits with the adapter folded in
(`merge_and_unload`): QLoRA's adapter is merged into the 16-bit base, not the NF4 one it trained on. A full
fine-tune of transformers' class saves the trained weights (gathered from ZeRO-3's partitions). Each folder is
written beside its target and renamed over it, as every export here is.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from adaptive.errors import AdaptiveError
from adaptive.train.run_folder.checkpoint import fsync_tree, os_reason, replace_dir

logger = logging.getLogger(__name__)

ADAPTER = "adapter"  # the run folder's adapter export (final); interim ones are adapter-step_N


def adapter_target(hf_target: Path) -> Path:
    """hf/ -> adapter/, hf-step_00000010/ -> adapter-step_00000010/."""
    return hf_target.with_name(ADAPTER + hf_target.name[len("hf"):])


def export_finetune(accelerator: Any, engine: Any, tokenizer: Any, target: Path, init_from: str,
                    metadata: dict[str, Any]) -> Path:
    """Write `target` (the merged or fully trained HF model) and, for an adapter run, its adapter folder beside it.
    All ranks call it (ZeRO-3's gathers are collectives); rank 0 writes."""
    from adaptive.models.finetune import is_peft

    model = accelerator.unwrap_model(engine)
    main = accelerator.is_main_process
    zero3 = accelerator.deepspeed_config["zero_optimization"]["stage"] == 3
    target = Path(target)
    if is_peft(model):
        adapter = adapter_target(target)
        _write(adapter, main, lambda tmp: _save_adapter(model, tmp, zero3), accelerator)
        with _zero3_init_hidden(accelerator, zero3):
            _write(target, main, lambda tmp: _save_merged(init_from, adapter, tokenizer, tmp, metadata), accelerator)
        logger.info("adapter exported to %s, merged model to %s", adapter, target)
        return target
    state_dict = accelerator.get_state_dict(engine) if zero3 else None  # gathers the partitions (a collective)
    _write(target, main, lambda tmp: _save_full(model, state_dict, tokenizer, tmp, metadata), accelerator)
    logger.info("HF model exported to %s", target)
    return target


@contextmanager
def _zero3_init_hidden(accelerator: Any, zero3: bool) -> Iterator[None]:
    """While the run's ZeRO-3 config is registered with transformers (accelerate's DeepSpeed plugin registers it),
    from_pretrained builds every model under deepspeed.zero.Init, whose partitioning is a collective: rank 0 alone
    rebuilding the base for the merge then waits for ranks that wait at the export's barrier (a hang until the
    collective timeout). Unregister it meanwhile; the merge is a plain CPU model."""
    registered = getattr(accelerator.state.deepspeed_plugin, "dschf", None)  # the plugin's HfDeepSpeedConfig
    if not zero3 or registered is None:
        yield
        return
    from transformers.integrations import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(registered)


def _write(target: Path, main: bool, save: Any, accelerator: Any) -> None:
    """Run `save(tmp)` on rank 0 into a folder beside `target`, then rename it over `target`; a failed write removes
    its partial folder and says so in one line."""
    tmp = target.with_name(f".{target.name}.tmp")
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        save(tmp)
        if main:
            fsync_tree(tmp)
            replace_dir(tmp, target)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise AdaptiveError(f"the export {target} could not be written ({os_reason(err)}); the checkpoints hold the "
                            "model: fix that and --resume") from None
    accelerator.wait_for_everyone()


def _save_adapter(model: Any, tmp: Path, zero3: bool) -> None:
    """PEFT's adapter files; under ZeRO-3 the trained parameters are gathered first (every rank enters the context,
    rank 0 writes)."""
    import torch.distributed as dist

    trained = [p for p in model.parameters() if p.requires_grad]
    gathered = nullcontext()
    if zero3:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(trained)
    with gathered:
        if not dist.is_initialized() or dist.get_rank() == 0:
            model.save_pretrained(str(tmp))


def _save_merged(init_from: str, adapter: Path, tokenizer: Any, tmp: Path, metadata: dict[str, Any]) -> None:
    if _not_main():
        return
    from transformers import AutoConfig

    from adaptive.models.finetune import DTYPES, merged_model

    dtype = getattr(AutoConfig.from_pretrained(init_from), "dtype", None)
    dtype = dtype if dtype in DTYPES.values() else DTYPES["bf16"]
    merged_model(init_from, adapter, dtype).save_pretrained(str(tmp))
    _finish(tmp, tokenizer, {**metadata, "format": "merged", "adapter": str(adapter)})


def _save_full(model: Any, state_dict: dict[str, Any] | None, tokenizer: Any, tmp: Path,
               metadata: dict[str, Any]) -> None:
    if _not_main():
        return
    model.save_pretrained(str(tmp), **({"state_dict": state_dict} if state_dict is not None else {}))
    _finish(tmp, tokenizer, {**metadata, "format": "transformers"})


def _finish(tmp: Path, tokenizer: Any, metadata: dict[str, Any]) -> None:
    tokenizer.save_pretrained(str(tmp))  # with its chat template
    (tmp / "adaptive_export.json").write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")


def _not_main() -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_rank() != 0


__all__ = ["ADAPTER", "adapter_target", "export_finetune"]
