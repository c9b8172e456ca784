"""A downloaded checkpoint as transformers' own class, with its fine-tuning method applied.

The method is a transform between building the model and handing it to DeepSpeed (torchtitan's model converters),
not a branch through the model: `load_pretrained` builds transformers' class of the checkpoint's family (for QLoRA
with a bitsandbytes NF4 base, double-quantized), `apply_method` freezes it and wraps it in PEFT's LoRA (lora,
qlora) or leaves it whole (full). We never reimplement a family to fine-tune it; our own classes serve our own
exports. `merged_model` folds a saved adapter into a fresh 16-bit base: what the run exports as its HF model.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from adaptive.errors import AdaptiveError
from adaptive.plan.architecture.families import peft_target_modules
from adaptive.plan.architecture.presets import ModelSpec
from adaptive.plan.finetune.method import Finetune

logger = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def compute_dtype(precision: str) -> torch.dtype:
    """What a 4-bit base computes in: the run's 16-bit dtype (fp16 on a T4), bf16 for an fp32 run on a CPU."""
    return torch.float16 if precision == "fp16" else torch.bfloat16


def quantization_config(precision: str, zero_stage: int) -> Any:
    """bitsandbytes' NF4 with double quantization. Under ZeRO-3 the packed codes are stored in the compute dtype,
    the one dtype ZeRO-3 partitions (PEFT's DeepSpeed guide, "QLoRA and DeepSpeed with ZeRO3")."""
    from transformers import BitsAndBytesConfig

    compute = compute_dtype(precision)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute,
                              bnb_4bit_quant_storage=compute if zero_stage == 3 else torch.uint8)


def load_pretrained(path: str | Path, finetune: Finetune, precision: str, zero_stage: int, attention: str,
                    device: torch.device) -> Any:
    """transformers' AutoModelForCausalLM of the checkpoint at `path`: its weights in the run's precision, or (QLoRA)
    the linears in NF4 on `device`. Under ZeRO-3 transformers builds it partitioned (accelerate's DeepSpeed plugin
    has turned zero.Init on by then)."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": DTYPES[precision], "attn_implementation": attention}
    if finetune.quantized:
        kwargs["quantization_config"] = quantization_config(precision, zero_stage)
        # the modules left in 16 bits (embeddings, norms, the head) in the compute dtype, or in the storage dtype
        # under ZeRO-3, as PEFT's DeepSpeed guide loads them
        kwargs["dtype"] = compute_dtype(precision)
        if zero_stage != 3:  # ZeRO-3 places and partitions the model itself; transformers refuses a device_map there
            kwargs["device_map"] = {"": device.index if device.type == "cuda" and device.index is not None
                                    else str(device)}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(Path(path).expanduser()), **kwargs)
    except (OSError, ValueError) as err:
        raise AdaptiveError(f"--init-from {str(path)!r}: transformers cannot load it: "
                            f"{' '.join(str(err).split())[:300]}") from None
    # no KV cache while training: it is memory the plan does not count, and with one transformers reads packed
    # examples' position_ids as one sequence (masking_utils only finds packed sequences without a cache)
    model.config.use_cache = False
    if finetune.quantized and device.type == "cpu":
        keep_training_kernel(model)
    return model


def keep_training_kernel(model: Any) -> None:
    """Keep bitsandbytes' 4-bit linears on the kernel they train with when evaluating on a CPU. On a CPU with
    AVX512-BF16, bitsandbytes 0.50 repacks a Linear4bit's weight for its inference kernel the first time it runs in
    eval mode without grad (nn/modules.py Linear4bit.forward): that fails for an in_features not a multiple of the
    block size ("shape '[64, 2]' is invalid for input of size 160"), rounds the scales to bf16 (eval would compute
    with another base than training) and leaves the weight repacked for the steps after the eval."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def enable_checkpointing(model: Any, policy: str) -> None:
    """transformers' own activation checkpointing (non-reentrant): every layer (full) or every N-th (every:N)."""
    if policy == "off":
        return
    if policy == "mlp":
        raise AdaptiveError("checkpointing policy 'mlp' needs adaptive's model class; transformers' classes "
                            "checkpoint whole layers (full or every:N)")
    every = 1 if policy == "full" else int(policy.split(":")[1])
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                          every_n_layers=every)


def apply_method(model: Any, spec: ModelSpec, finetune: Finetune, checkpoint_policy: str) -> Any:
    """Full: the model as it is, checkpointed as planned. LoRA/QLoRA: frozen, checkpointed (the embedding's output
    made to require grad, so the recomputed layers reach the adapters), wrapped in PEFT's LoRA."""
    if not finetune.adapted:
        enable_checkpointing(model, checkpoint_policy)
        return model
    from peft import LoraConfig, get_peft_model

    # A 4-bit base is not passed through PEFT's prepare_model_for_kbit_training: with checkpointing ours (as
    # planned), all it adds to this freeze is an fp32 copy of every weight bitsandbytes left in 16 bits, which
    # DeepSpeed casts back to 16 bits at initialize (engine._cast_module_mixed_precision). Until then the copy is
    # only a load-time surge: +2 GiB for Llama 3.1 8B's embedding and head, +90 GB for Mixtral's 3D experts.
    # TRL skips it for sharded QLoRA for the same reason. The plan counts the base as DeepSpeed holds it.
    model.requires_grad_(False)
    enable_checkpointing(model, checkpoint_policy)
    if checkpoint_policy != "off":
        model.enable_input_require_grads()
    config = LoraConfig(r=finetune.lora_rank, lora_alpha=finetune.alpha, lora_dropout=finetune.lora_dropout,
                        target_modules=peft_target_modules(spec, finetune.lora_targets), bias="none",
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def merged_model(base_path: str | Path, adapter_path: str | Path, dtype: torch.dtype = torch.bfloat16) -> Any:
    """The base checkpoint in 16 bits on the CPU with the adapter folded in (PEFT's merge_and_unload): a plain
    transformers model. For QLoRA the adapter is merged into the 16-bit base, not the NF4 one it trained on."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(Path(base_path).expanduser()), dtype=dtype)
    return PeftModel.from_pretrained(base, str(adapter_path)).merge_and_unload()


__all__ = ["DTYPES", "apply_method", "compute_dtype", "enable_checkpointing", "is_peft", "keep_training_kernel",
           "load_pretrained", "merged_model", "quantization_config"]
