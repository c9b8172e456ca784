"""What a fine-tune may combine, each rule with its source, and which ZeRO/offload/layout candidates the search tries.

A fine-tune trains transformers' own class of the checkpoint's family (families.py). LoRA and QLoRA are planned
with ZeRO data parallelism, as PEFT's DeepSpeed guide runs them; QLoRA's 4-bit base stays on the GPU.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from adaptive.plan.architecture.families import family_of, resolve_targets
from adaptive.plan.estimate.nvme import DEFAULT_DRIVE
from adaptive.plan.estimate.optimizers import EIGHT_BIT, is_paged

if TYPE_CHECKING:
    from adaptive.plan.search.request import FitRequest

QLORA_OFFLOAD = ("bitsandbytes' 4-bit weights stay on the GPU (DeepSpeed does not offload them), PEFT's DeepSpeed "
                 "guide reports ZeRO-3 + QLoRA with CPU offload using more GPU memory than without, and the adapters' "
                 "optimizer states are small anyway")
NVME_NEEDS_ZERO3 = ("ZeRO-Infinity's NVMe offload needs ZeRO-3: DeepSpeed's ZeRO-1/2 given device nvme offload to "
                    "the CPU instead and write nothing (runtime/zero/stage_1_and_2.py)")


def transformers_moe(req: FitRequest) -> bool:
    """An MoE config.json fine-tuned with transformers' own class: its experts are ordinary parameters (no DeepSpeed
    MoE layer), so ZeRO-3 applies and there is no expert parallelism."""
    return req.finetune is not None and req.spec.is_moe and req.spec.model_type != "adaptive"


def finetune_error(req: FitRequest) -> str | None:
    """The first combination a fine-tune (or an 8-bit optimizer, or NVMe offload) cannot run, in one line."""
    ft, spec = req.finetune, req.spec
    offload = req.offload or "none"
    if ft is not None and ft.adapted:
        if spec.source == "preset":
            return (f"--finetune {ft.method} adapts a checkpoint you downloaded; preset {spec.name} has no weights "
                    "(LoRA on random weights learns nothing): give --model PATH/config.json of the checkpoint, or "
                    "--finetune full")
        if spec.model_type == "adaptive":
            return (f"--finetune {ft.method} is planned for transformers' decoders ({family_of(spec).model_type} is "
                    "adaptive's own class): fine-tune an adaptive export with --finetune full")
        pins = [f"--{k}-size {v}" for k, v in (("tp", req.tp_size), ("sp", req.sp_size), ("pp", req.pp_size))
                if (v or 1) > 1]
        pins += ["--zero-hpz" for _ in [1] if (req.zero_hpz or 1) > 1]
        pins += ["--zero-quantize" for _ in [1] if req.zero_quantized_weights or req.zero_quantized_gradients]
        if pins:
            return (f"{pins[0]} does not apply to --finetune {ft.method}: LoRA and QLoRA are planned with ZeRO data "
                    "parallelism only (tensor, sequence and pipeline parallelism of PEFT's layers are untested here)")
        if ft.quantized and offload != "none" and req.framework == "deepspeed":  # FSDP's CPU offload moves them
            return f"--finetune qlora cannot take --offload {offload}: {QLORA_OFFLOAD}; use --offload none"
        if ft.lora_dropout and any(m.role == "experts" for m in resolve_targets(spec, ft.lora_targets)):
            return (f"--lora-dropout {ft.lora_dropout:g} with LoRA on {spec.model_type}'s experts: PEFT's adapter on "
                    "3D expert parameters refuses dropout (lora.ParamWrapper); use --lora-dropout 0, or targets "
                    "without the experts (--lora-targets attention)")
    if transformers_moe(req) and (req.ep_size or 1) > 1:
        return (f"--ep-size {req.ep_size} does not apply to a fine-tune of {spec.model_type}: transformers' "
                f"{family_of(spec).class_name} holds every expert on every GPU (expert parallelism is adaptive's "
                "DeepSpeed-MoE models')")
    if is_paged(req.optimizer) and offload != "none":
        return (f"--optimizer {req.optimizer} pages GPU states to the host; under --offload {offload} they are on the "
                "host already: use --optimizer adamw_8bit")
    if req.optimizer in EIGHT_BIT and offload in ("nvme", "nvme-optimizer"):
        return (f"--optimizer {req.optimizer} with --offload {offload} is not planned: NVMe offload is planned with "
                "DeepSpeed's own CPU Adam (8-bit states under ZeRO-Infinity's fp32 swapper are untested); use "
                "--optimizer auto")
    if offload in ("nvme", "nvme-optimizer"):
        if req.zero_stage not in (None, 3):
            return f"--offload {offload} with --zero {req.zero_stage}: {NVME_NEEDS_ZERO3}"
        if spec.is_moe and not transformers_moe(req):
            return (f"--offload {offload} needs ZeRO-3, which DeepSpeed's native MoE refuses "
                    "(\"Native DeepSpeed MoE is not supported with ZeRO Stage 3\")")
        if spec.is_moe:
            return f"--offload {offload} is planned for dense models; {spec.model_type}'s experts are not modelled there"
        if req.nvme_path is None:
            return f"--offload {offload} needs --nvme-path DIR: the folder on the NVMe drive DeepSpeed swaps to"
    return None


def stages_for(req: FitRequest, stages: list[int]) -> list[int]:
    """ZeRO stages the search tries: DeepSpeed's native MoE refuses ZeRO-3; transformers' MoE classes do not."""
    if req.spec.is_moe and not transformers_moe(req):
        return [z for z in stages if z != 3]
    return stages


def offloads_for(req: FitRequest, zero: int, offloads: tuple[str, ...]) -> list[str]:
    """The --offload values worth trying at this ZeRO stage: QLoRA offloads nothing, a paged optimizer pages instead
    of offloading, NVMe is tried under ZeRO-3 where the user named a drive."""
    if req.offload:
        return [req.offload]
    if req.finetune is not None and req.finetune.quantized and req.framework == "deepspeed" or is_paged(req.optimizer):
        return ["none"]
    nvme = (["nvme-optimizer", "nvme"] if req.nvme_path is not None and zero == 3 and req.optimizer not in EIGHT_BIT
            and not req.spec.is_moe else [])
    return [*offloads, *nvme]


def finetune_rungs(req: FitRequest, zero: int, offload: str) -> list[tuple[str, FitRequest, int, str]]:
    """A fine-tune's OOM playbook past checkpointing, in order, each rung on top of the one before: an 8-bit optimizer,
    LoRA, QLoRA; then, instead, a full fine-tune with its states and parameters on NVMe (ZeRO-Infinity). Each rung is
    (what it changes, the request with it, ZeRO stage, offload)."""
    ft = req.finetune
    if ft is None:
        return []
    out: list[tuple[str, FitRequest, int, str]] = []
    nvme = offload in ("nvme", "nvme-optimizer")
    current = req
    if not ft.adapted and req.optimizer not in EIGHT_BIT and not nvme:
        current = replace(current, optimizer="adamw_8bit")
        out.append(("+ 8-bit optimizer (adamw_8bit)", current, zero, offload))
    if not ft.adapted:
        lora = replace(ft, method="lora")
        current = replace(current, finetune=lora, optimizer="auto")
        out.append((f"+ LoRA (rank {lora.lora_rank}, {lora.lora_targets}) on the frozen 16-bit base", current, zero,
                    "none" if nvme else offload))
    if not ft.quantized:
        current = replace(current, finetune=replace(current.finetune, method="qlora"))
        out.append(("+ QLoRA (the base in NF4, double-quantized)", current, zero, "none"))
    if not ft.adapted and not req.spec.is_moe and not nvme:
        out.append(("instead: full fine-tune, ZeRO-3 with states and parameters on NVMe",
                    replace(req, nvme=req.nvme or DEFAULT_DRIVE, optimizer="auto"), 3, "nvme"))
    return out


__all__ = ["finetune_error", "finetune_rungs", "offloads_for", "stages_for", "transformers_moe"]
