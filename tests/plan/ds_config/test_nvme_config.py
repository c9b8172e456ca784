"""The ZeRO-Infinity sections we emit (ds_config/nvme.py) pass DeepSpeed's own DeepSpeedConfig, carry the values
the host-RAM formulas assume, and are never emitted for ZeRO-1/2."""

import pytest
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

from adaptive.errors import AdaptiveError
from adaptive.plan.architecture.presets import ModelSpec
from adaptive.plan.ds_config.nvme import nvme_sections, with_nvme
from adaptive.plan.estimate import memory as mem
from adaptive.plan.estimate import nvme as nv
from adaptive.plan.finetune.method import make_finetune
from tests._deepspeed_config import DataParallel, single_process_group  # noqa: F401 (fixture)

LLAMA3_8B = ModelSpec(name="llama3-8b", arch="dense", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      layer_types=("dense",) * 32)


def _zero3(gpus: int = 1, stage: int = 3) -> dict:
    """A ds_config as emit.ds_config writes one for ZeRO-3 (batch sizes, bf16, its buckets)."""
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 200_000_000}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=mem.STAGE3_PREFETCH_ELEMENTS,
                    stage3_max_live_parameters=mem.STAGE3_MAX_LIVE_PARAMETERS,
                    stage3_max_reuse_distance=mem.STAGE3_MAX_LIVE_PARAMETERS,
                    stage3_param_persistence_threshold=100_000, stage3_gather_16bit_weights_on_model_save=True)
    return {"train_batch_size": 4 * gpus, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
            "gradient_clipping": 1.0, "zero_optimization": zero, "bf16": {"enabled": True}, "steps_per_print": 100}


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("params_on_nvme", [True, False])
def test_deepspeed_accepts_what_we_emit(single_process_group, lora, params_on_nvme):
    ft = make_finetune("lora", lora_rank=16) if lora else None
    setup = nv.NvmeSetup(nv.zero_tensors(LLAMA3_8B, ft), params_on_nvme=params_on_nvme)
    cfg = with_nvme(_zero3(), setup, "/local_nvme", lora=lora)
    parsed = DeepSpeedConfig(cfg, mpu=DataParallel(1))
    z = parsed.zero_config
    assert parsed.zero_optimization_stage == 3
    assert z.offload_optimizer.device == OffloadDeviceEnum.nvme and str(z.offload_optimizer.nvme_path) == "/local_nvme"
    assert z.offload_optimizer.buffer_count == nv.OPTIMIZER_BUFFER_COUNT and not z.offload_optimizer.pipeline
    assert z.sub_group_size == nv.SUB_GROUP_ELEMENTS
    if params_on_nvme:
        assert z.offload_param.device == OffloadDeviceEnum.nvme
        assert z.offload_param.buffer_count == nv.PARAM_BUFFER_COUNT
        assert z.offload_param.buffer_size == 128256 * 4096  # the embedding: what DeepSpeed must fit in one buffer
        assert z.offload_param.max_in_cpu == nv.MAX_IN_CPU_ELEMENTS
    else:
        assert z.offload_param is None
    # NVMe parameters: each is released after use, else gathered ones keep every swap buffer
    assert z.max_reuse_distance == (0 if params_on_nvme else mem.STAGE3_MAX_LIVE_PARAMETERS)
    # LoRA with NVMe parameters: prefetching off, else DeepSpeed fails at step 1
    assert z.prefetch_bucket_size == (0 if lora and params_on_nvme else mem.STAGE3_PREFETCH_ELEMENTS)
    # the aio section DeepSpeed reads (swap_tensor/aio_config.py) is ours, key for key
    assert parsed.aio_config == {"block_size": nv.AIO_BLOCK_SIZE, "queue_depth": nv.AIO_QUEUE_DEPTH,
                                 "intra_op_parallelism": nv.AIO_INTRA_OP_PARALLELISM,
                                 "single_submit": nv.AIO_SINGLE_SUBMIT, "overlap_events": nv.AIO_OVERLAP_EVENTS,
                                 "use_gds": False}
    assert "thread_count" not in cfg["aio"]


def test_multi_gpu_buffers_follow_the_partition(single_process_group):
    setup = nv.NvmeSetup(nv.zero_tensors(LLAMA3_8B), partition_size=8, ranks_per_node=8)
    cfg = with_nvme(_zero3(gpus=8), setup, "/local_nvme", lora=False)
    parsed = DeepSpeedConfig(cfg, mpu=DataParallel(8))
    assert parsed.zero_config.offload_param.buffer_size == 128256 * 4096 // 8  # one rank's embedding partition
    assert parsed.train_batch_size == 32


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_1_and_2_with_nvme_are_never_emitted(single_process_group, stage):
    setup = nv.NvmeSetup(nv.zero_tensors(LLAMA3_8B), params_on_nvme=False)
    with pytest.raises(AdaptiveError, match="needs ZeRO-3"):
        nvme_sections(setup, "/local_nvme", lora=False, zero_stage=stage)
    with pytest.raises(AdaptiveError, match="needs ZeRO-3"):
        with_nvme(_zero3(stage=stage), setup, "/local_nvme", lora=False)
    if stage:
        # why we refuse: DeepSpeed itself takes the file and would quietly offload to host RAM
        cfg = _zero3(stage=stage)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/local_nvme"}
        assert DeepSpeedConfig(cfg, mpu=DataParallel(1)).zero_config.offload_optimizer.device == OffloadDeviceEnum.nvme


def test_an_empty_nvme_path_is_refused():
    setup = nv.NvmeSetup(nv.zero_tensors(LLAMA3_8B))
    with pytest.raises(AdaptiveError, match="nvme-path"):
        nvme_sections(setup, "  ", lora=False)


def test_with_nvme_replaces_a_cpu_offload_and_keeps_the_rest():
    cfg = _zero3()
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    out = with_nvme(cfg, nv.NvmeSetup(nv.zero_tensors(LLAMA3_8B), params_on_nvme=False), "/nvme", lora=False)
    assert "offload_param" not in out["zero_optimization"]  # nvme-optimizer: the 16-bit partitions stay on the GPU
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"  # the input is not changed
    assert out["train_batch_size"] == cfg["train_batch_size"] and out["bf16"] == {"enabled": True}
