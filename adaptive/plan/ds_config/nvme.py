"""The ds_config sections of a ZeRO-Infinity plan: `offload_optimizer` / `offload_param` on NVMe and `aio`.

Every value comes from adaptive/plan/estimate/nvme.py, so what DeepSpeed allocates is what its host-RAM and NVMe
formulas count. tests/plan/ds_config/test_nvme_config.py checks DeepSpeed's own DeepSpeedConfig accepts them.
"""

from __future__ import annotations

import copy

from adaptive.errors import AdaptiveError
from adaptive.plan.estimate import nvme as nv
from adaptive.plan.estimate.nvme import NvmeSetup


def nvme_sections(setup: NvmeSetup, nvme_path: str, *, lora: bool, zero_stage: int = 3) -> dict:
    """{"zero_optimization": {keys to set}, "aio": {...}} for `setup` (params_on_nvme: `--offload nvme`; else
    `--offload nvme-optimizer`). AdaptiveError for a ZeRO stage other than 3: DeepSpeed's ZeRO-1/2 accept
    `"device": "nvme"` and silently offload to host RAM instead, writing nothing (zero/stage_1_and_2.py ~220)."""
    if zero_stage != 3:
        raise AdaptiveError(f"--offload nvme needs ZeRO-3, got ZeRO-{zero_stage}: DeepSpeed's ZeRO-1/2 would "
                            f"silently offload to host RAM instead")
    path = str(nvme_path).strip()
    if not path:
        raise AdaptiveError("--nvme-path is empty; give a directory on the node-local NVMe drive")
    zero: dict = {
        "offload_optimizer": {
            "device": "nvme", "nvme_path": path, "pin_memory": True,
            "buffer_count": setup.optimizer_buffer_count,
            # the plain swapper (partitioned_optimizer_swapper.py): one sub-group's tensors at a time
            "pipeline_read": False, "pipeline_write": False,
            # fast_init swaps 16-bit partitions straight into fp32 files and needs every param buffer to hold a
            # whole sub-group (swap_tensor/optimizer_utils.py:303); the plain path goes through host RAM once
            "fast_init": False,
        },
        # the optimizer's tile: its pinned pool holds buffer_count of the largest (estimate/nvme.py)
        "sub_group_size": setup.sub_group_size,
    }
    if setup.params_on_nvme:
        zero["offload_param"] = {
            "device": "nvme", "nvme_path": path, "pin_memory": True,
            "buffer_count": setup.param_buffer_count,
            "buffer_size": (setup.param_buffer_size if setup.param_buffer_size is not None
                            else nv.param_buffer_elements(setup)),
            "max_in_cpu": setup.max_in_cpu,
        }
        # A gathered parameter keeps its partition in a swap buffer until released (partition_parameters.py
        # :1807-1809), and ZeRO-3 releases none that is used again within stage3_max_reuse_distance elements
        # (partitioned_param_coordinator.py:653-662). With our 1e9 every partition of a model under 1e9 stays, so
        # the sixth one swapped in fails "Not enough buffers 0 for swapping 1" (partitioned_param_swapper.py:310;
        # seen on a 12M-parameter model, full and LoRA). 0 releases each after use; buffer_count then bounds one
        # module's partitions plus the NVMe prefetch, which takes free buffers only.
        zero["stage3_max_reuse_distance"] = 0
        if lora:
            # LoRA + ZeRO-3 + NVMe params fails at step 1 with "param ... already assigned swap buffer id"
            # (swap_tensor/partitioned_param_swapper.py:185) unless prefetching is off
            zero["stage3_prefetch_bucket_size"] = 0
    aio = {
        "block_size": setup.aio_block_size,
        "queue_depth": nv.AIO_QUEUE_DEPTH,
        "intra_op_parallelism": setup.aio_intra_op_parallelism,  # 0.19.8 no longer reads `thread_count`
        "single_submit": nv.AIO_SINGLE_SUBMIT,
        "overlap_events": nv.AIO_OVERLAP_EVENTS,
        "use_gds": False,  # GPUDirect Storage asserts a CUDA accelerator and its own op (swap_tensor/aio_config.py:38-39)
    }
    return {"zero_optimization": zero, "aio": aio}


def with_nvme(cfg: dict, setup: NvmeSetup, nvme_path: str, *, lora: bool) -> dict:
    """A copy of a ZeRO-3 ds_config with its offload sections replaced by the NVMe ones."""
    out = copy.deepcopy(cfg)
    zero = out.setdefault("zero_optimization", {})
    sections = nvme_sections(setup, nvme_path, lora=lora, zero_stage=int(zero.get("stage", 0)))
    zero.pop("offload_param", None)  # nvme-optimizer: the 16-bit partitions stay on the GPU
    zero.update(sections["zero_optimization"])
    out["aio"] = sections["aio"]
    return out


__all__ = ["nvme_sections", "with_nvme"]
