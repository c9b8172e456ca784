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

- `adamw_8bit`: bitsandbytes' AdamW8bit: both moments as 8-bit codes in blocks of 256 values, each block with a
  float32 absmax (bitsandbytes/optim/optimizer.py, Optimizer2State with block_wise=True): 2 + 8/256 bytes per
  parameter instead of Adam's 8. The update runs in place, one kernel per tensor. DeepSpeed still keeps its fp32
  master copy (4 bytes) and hands the optimizer that flat fp32 partition, a client optimizer under ZeRO (with
  `zero_allow_untested_optimizer`). bitsandbytes keeps 32-bit moments for tensors under 4096 values: DeepSpeed's
  flat partitions are far larger.
- `paged_adamw_8bit`: the same states in CUDA managed memory (cudaMallocManaged): the driver moves their pages to
  host RAM when the GPU runs short, so they never cause an out-of-memory error (PyTorch's allocator does not see
  them) but cost transfers when they spill. Under optimizer offload the states are on the host already: use
  adamw_8bit there.

A DeepSpeed JSON with `"torch_adam": true` in its optimizer params builds torch AdamW instead of
FusedAdam: on a GPU that is the foreach path, i.e. `adamw_torch`.
"""

from __future__ import annotations

from adaptive.errors import AdaptiveError, closest

FP32_BYTES = 4
MASTER_BYTES = 4  # DeepSpeed's fp32 master copy of each trained parameter, whatever the optimizer
ADAM_STATE_BYTES = 8  # fp32 m and v
BNB_BLOCK = 256  # bitsandbytes' 8-bit optimizer block (one float32 absmax per block and state)
EIGHT_BIT_STATE_BYTES = 2 + 2 * 4 / BNB_BLOCK  # two 8-bit moments and their absmaxes

# name -> fp32 temporaries per updated parameter during the step (count of param-sized fp32 tensors)
TRANSIENT_COPIES: dict[str, int] = {
    "auto": 0,
    "adamw_torch": 1,  # foreach: exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs)
    "adamw_torch_fused": 0,
    "deepspeed_fused_adam": 0,
    "deepspeed_cpu_adam": 0,
    "adamw_8bit": 0,  # bitsandbytes' blockwise kernels update in place
    "paged_adamw_8bit": 0,
}
OPTIMIZERS = tuple(TRANSIENT_COPIES)
EIGHT_BIT = ("adamw_8bit", "paged_adamw_8bit")  # bitsandbytes': a client optimizer DeepSpeed does not build

DESCRIPTIONS: dict[str, str] = {
    "auto": "fused torch AdamW (DeepSpeedCPUAdam under offload), as adaptive's loop builds it",
    "adamw_torch": "torch AdamW, foreach path: one fp32 temporary per updated parameter in the step",
    "adamw_torch_fused": "torch AdamW fused=True: no temporaries",
    "deepspeed_fused_adam": "DeepSpeed FusedAdam: in place, no temporaries",
    "deepspeed_cpu_adam": "DeepSpeedCPUAdam on the host (optimizer offload)",
    "adamw_8bit": "bitsandbytes AdamW8bit: 8-bit moments in blocks of 256 (2.03 bytes/param instead of 8)",
    "paged_adamw_8bit": "bitsandbytes PagedAdamW8bit: 8-bit moments in managed memory that pages to the host",
}


def check_optimizer(name: str) -> str:
    """The canonical name, or AdaptiveError naming the nearest valid one."""
    key = name.strip().lower().replace("-", "_")
    if key in TRANSIENT_COPIES:
        return key
    near = closest(key, list(OPTIMIZERS))
    hint = f"; did you mean {near}?" if near else ""
    raise AdaptiveError(f"unknown --optimizer {name!r}{hint} (choose from {', '.join(OPTIMIZERS)})")


def state_bytes_per_param(optimizer: str, precision: str = "mixed", param_bytes: int = 2) -> float:
    """Optimizer states per trained parameter beyond the fp32 master copy: Adam's two fp32 moments, or 8-bit ones.
    Under "pure" precision (memory.PRECISIONS) torch's Adam keeps its moments in the parameter's dtype
    (torch/optim/adamw.py: torch.zeros_like(p)); bitsandbytes' 8-bit states are 8-bit codes whatever it updates."""
    if optimizer in EIGHT_BIT:
        return EIGHT_BIT_STATE_BYTES
    return 2 * param_bytes if precision == "pure" else ADAM_STATE_BYTES


def is_paged(optimizer: str) -> bool:
    """States in CUDA managed memory: they page to the host instead of running the GPU out of memory."""
    return optimizer == "paged_adamw_8bit"


def step_transient_bytes(optimizer: str, updated_params_on_gpu: float, offload_optimizer: bool,
                         precision: str = "mixed", param_bytes: int = 2) -> int:
    """GPU bytes the optimizer allocates during its step beyond states and gradients.

    `updated_params_on_gpu`: parameters this GPU's optimizer updates (its ZeRO partition, or all local
    parameters under ZeRO-0). Under optimizer offload the step runs on the host: nothing on the GPU. Under "pure"
    precision the temporaries take the moments' dtype, the parameters'.
    """
    if offload_optimizer:
        return 0
    element = param_bytes if precision == "pure" else FP32_BYTES
    return int(TRANSIENT_COPIES[optimizer] * element * updated_params_on_gpu)


__all__ = ["ADAM_STATE_BYTES", "DESCRIPTIONS", "EIGHT_BIT", "MASTER_BYTES", "OPTIMIZERS", "check_optimizer",
           "is_paged", "state_bytes_per_param", "step_transient_bytes"]
