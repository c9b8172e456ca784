"""The optimizer step's transient GPU memory, by implementation (`adaptive fit --optimizer`).

Names are the ones users know from transformers' `TrainingArguments.optim`, plus DeepSpeed's own:

- `auto` (default): what `adaptive` itself runs. Our training loop builds a fused torch AdamW
  (`torch.optim.AdamW(fused=True)`) on DeepSpeed's fp32 partition, and DeepSpeedCPUAdam under
  optimizer offload. Neither allocates temporaries of the parameters' size.
- `adamw_torch`: torch AdamW with its default multi-tensor ("foreach") path. Its step computes
  `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)` out of place (torch/optim/adam.py,
  `_multi_tensor_adam`), one fp32 temporary per parameter it updates, all alive at once, on top of the
  fp32 gradients DeepSpeed built for the step. Every other foreach op there is in place. Measured on a
  real DeepSpeed engine: tests/plan/estimate/test_memory_measured_deepspeed_inputs.py.
- `adamw_torch_fused`: torch AdamW with `fused=True`: one kernel per tensor group, no temporaries.
- `deepspeed_fused_adam`: DeepSpeed's `FusedAdam` (what a ds_config `"optimizer": {"type": "AdamW"}`
  builds on a GPU): `multi_tensor_apply` updates in place, no temporaries.
- `deepspeed_cpu_adam`: `DeepSpeedCPUAdam`, runs on the host; only with optimizer offload.

A DeepSpeed JSON with `"torch_adam": true` in its optimizer params builds torch AdamW instead of
FusedAdam: on a GPU that is the foreach path, i.e. `adamw_torch`.
"""

from __future__ import annotations

from adaptive.errors import AdaptiveError, closest

FP32_BYTES = 4

# name -> fp32 temporaries per updated parameter during the step (count of param-sized fp32 tensors)
TRANSIENT_COPIES: dict[str, int] = {
    "auto": 0,
    "adamw_torch": 1,  # foreach: exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs)
    "adamw_torch_fused": 0,
    "deepspeed_fused_adam": 0,
    "deepspeed_cpu_adam": 0,
}
OPTIMIZERS = tuple(TRANSIENT_COPIES)

DESCRIPTIONS: dict[str, str] = {
    "auto": "fused torch AdamW (DeepSpeedCPUAdam under offload), as adaptive's loop builds it",
    "adamw_torch": "torch AdamW, foreach path: one fp32 temporary per updated parameter in the step",
    "adamw_torch_fused": "torch AdamW fused=True: no temporaries",
    "deepspeed_fused_adam": "DeepSpeed FusedAdam: in place, no temporaries",
    "deepspeed_cpu_adam": "DeepSpeedCPUAdam on the host (optimizer offload)",
}


def check_optimizer(name: str) -> str:
    """The canonical name, or AdaptiveError naming the nearest valid one."""
    key = name.strip().lower().replace("-", "_")
    if key in TRANSIENT_COPIES:
        return key
    near = closest(key, list(OPTIMIZERS))
    hint = f"; did you mean {near}?" if near else ""
    raise AdaptiveError(f"unknown --optimizer {name!r}{hint} (choose from {', '.join(OPTIMIZERS)})")


def step_transient_bytes(optimizer: str, updated_params_on_gpu: float, offload_optimizer: bool) -> int:
    """GPU bytes the optimizer allocates during its step beyond states and gradients.

    `updated_params_on_gpu`: parameters this GPU's optimizer updates (its ZeRO partition, or all local
    parameters under ZeRO-0). Under optimizer offload the step runs on the host: nothing on the GPU.
    """
    if offload_optimizer:
        return 0
    return int(TRANSIENT_COPIES[optimizer] * FP32_BYTES * updated_params_on_gpu)


__all__ = ["OPTIMIZERS", "DESCRIPTIONS", "check_optimizer", "step_transient_bytes"]
