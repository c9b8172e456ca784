"""What a training stack other than adaptive's own may combine (FitRequest's `framework`, `precision`, `loss`,
`optimizer_in_backward`, `activation_offload`; estimate/memory.py FRAMEWORKS), each rule with its reason, and which
ZeRO stages and offloads the search tries under it. The evidence corpus's published fine-tunes set these knobs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from adaptive.plan.estimate.losses import LOSSES
from adaptive.plan.estimate.memory import FRAMEWORKS, PRECISIONS

if TYPE_CHECKING:
    from adaptive.plan.search.request import FitRequest

# zero_stage: how far each framework partitions (0 none, 2 gradients and optimizer states, 3 parameters too)
STAGES: dict[str, tuple[int, ...]] = {
    "deepspeed": (0, 1, 2, 3),
    "torch": (0,),  # one GPU, or DistributedDataParallel
    "fsdp": (0, 2, 3),  # NO_SHARD, SHARD_GRAD_OP, FULL_SHARD
    "fsdp_sharded_root": (2, 3),
}


def stack_error(req: FitRequest) -> str | None:
    """The first stack knob, or combination, that cannot be planned, in one line."""
    if req.framework not in FRAMEWORKS:
        return f"framework must be one of {', '.join(FRAMEWORKS)}, got {req.framework!r}"
    if req.precision not in PRECISIONS:
        return f"precision must be one of {', '.join(PRECISIONS)}, got {req.precision!r}"
    if req.loss is not None and req.loss not in LOSSES:
        return f"loss must be one of {', '.join(LOSSES)}, got {req.loss!r}"
    if req.loss is not None and req.kernels != "plain":
        return (f"loss {req.loss} describes a stack's transformers-style head (kernels plain); adaptive's lean blocks "
                "have their own tiled loss")
    if req.optimizer_in_backward and (req.grad_accum or 1) != 1:
        return "optimizer_in_backward steps at every backward: it needs grad_accum 1 (torchtune refuses accumulation)"
    if req.framework == "deepspeed":
        if req.precision == "pure":
            return ("precision pure: DeepSpeed's bf16 and fp16 optimizers keep fp32 master weights and moments; pure "
                    "16-bit training is planned with framework torch, fsdp or fsdp_sharded_root")
        if req.optimizer_in_backward:
            return ("optimizer_in_backward: DeepSpeed steps its own optimizer over its flat partitions after backward; "
                    "it is planned with framework torch, fsdp or fsdp_sharded_root")
        if req.activation_offload:
            return ("activation_offload is torchtune's (saved-tensor hooks around the model's forward); it is planned "
                    "with framework torch, fsdp or fsdp_sharded_root")
        return None
    layout = [name for name, v in (("tp_size", req.tp_size), ("sp_size", req.sp_size), ("pp_size", req.pp_size),
                                   ("zero_hpz", req.zero_hpz)) if (v or 1) > 1]
    layout += ["zero_quantize" for _ in [1] if req.zero_quantized_weights or req.zero_quantized_gradients]
    if layout:
        return f"{layout[0]} is DeepSpeed's; framework {req.framework} is planned with data parallelism only"
    if req.zero_stage is not None and req.zero_stage not in STAGES[req.framework]:
        return (f"framework {req.framework} partitions as ZeRO stage {' or '.join(map(str, STAGES[req.framework]))}, "
                f"not {req.zero_stage}")
    if req.offload not in (None, "none", "all"):
        return (f"offload {req.offload} is DeepSpeed's; framework {req.framework} offloads parameters, gradients and "
                "optimizer states together (FSDP's CPUOffload): offload all")
    if req.offload == "all" and req.framework == "torch":
        return "offload all is FSDP's CPU offload: framework fsdp or fsdp_sharded_root"
    if req.optimizer.startswith("deepspeed_"):
        return f"optimizer {req.optimizer} is DeepSpeed's; framework {req.framework} runs a torch or bitsandbytes one"
    return None


def stages_and_offloads(req: FitRequest, candidates: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The (ZeRO stage, offload) candidates this request's framework can run."""
    if req.framework == "deepspeed":
        return candidates
    return [(z, o) for z, o in candidates if z in STAGES[req.framework] and (o == "none" or o == "all" and z == 3
                                                                          and req.framework != "torch")]


__all__ = ["STAGES", "stack_error", "stages_and_offloads"]
