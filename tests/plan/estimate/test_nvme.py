"""ZeRO-Infinity's host RAM, NVMe bytes and NVMe traffic (estimate/nvme.py) against hand counts of DeepSpeed
0.19.8's allocations for two shapes, and the model's tensors against the parameter counts."""

import pytest

from adaptive.plan.architecture.params import count_params
from adaptive.plan.architecture.presets import PRESETS, ModelSpec, preset_spec
from adaptive.plan.estimate.nvme import (DEFAULT_DRIVE, GB, NvmeDrive, NvmeSetup, NvmeTraffic, ZeroTensors,
                                         estimate_nvme, host_bytes_per_node, nvme_bytes_per_node,
                                         param_buffer_elements, zero_tensors)
from adaptive.plan.finetune.method import make_finetune

# A: full fine-tune on one GPU. An embedding of 4 Mi elements, four 1 Mi linears, three 1024-element norms; tiles
# (sub-groups) of 3e6 elements and 5e6 trainable elements kept in host RAM.
FULL = ZeroTensors(trainable=((4_194_304, 1), (1_048_576, 4), (1024, 3)))
A = NvmeSetup(FULL, sub_group_size=3_000_000, max_in_cpu=5_000_000)


def test_full_finetune_one_gpu_host_ram_by_hand():
    # sub-groups: [embedding] 4,194,304 (reaches 3e6 alone); [3 linears] 3,145,728; [linear + norms] 1,051,648.
    # The first fits the 5e6 flat buffer; the other two spill to NVMe (4,194,304 + 3,145,728 > 5e6).
    e = estimate_nvme(A)
    assert e.host_parts == {
        "optimizer_swap_buffers": 4 * 4_194_304 * 4,  # 4 fp32 buffers of the largest sub-group
        "grad_partitions": 8_391_680 * 2,  # every trainable element's bf16 gradient partition
        "param_swap_buffers": 5 * 4_194_304 * 2,  # 5 bf16 buffers of the largest swapped partition
        "trainable_params_in_cpu": 5_000_000 * 2,  # the max_in_cpu flat buffer
        "param_write_back_buffer": 4_194_304 * 2,  # the largest sub-group, for spilled ones' write-back
        "small_param_partitions": 3 * 1024 * 2,  # the norms of a spilled sub-group (< 1 MiB: never swapped)
    }
    assert e.host_bytes_per_node == host_bytes_per_node(A) == 144_230_016
    assert e.param_buffer_size == param_buffer_elements(A) == 4_194_304


def test_full_finetune_one_gpu_nvme_and_traffic_by_hand():
    e = estimate_nvme(A)
    assert e.nvme_parts == {
        "optimizer_states": 3 * 4 * 8_391_680,  # fp32 master, m, v of every (swappable) sub-group
        "gradients": 4 * (4_194_304 + 4 * 1_048_576),  # fp32 gradients; the 4 KiB norm gradients stay in memory
        "params": 2 * (4_194_304 + 4 * 1_048_576),  # bf16 partitions of 1 MiB or more
    }
    assert e.nvme_bytes_per_node == nvme_bytes_per_node(A) == 151_031_808
    spilled = 4 * 1_048_576 * 2  # the linears of the two spilled sub-groups, read per pass, written per step
    assert e.step == NvmeTraffic(read_bytes=100_700_160 + 33_554_432, write_bytes=100_700_160 + 33_554_432 + spilled)
    assert e.micro_batch == NvmeTraffic(read_bytes=2 * spilled, write_bytes=0)
    assert e.step_seconds(grad_accum=2) == pytest.approx(
        (e.step.read_bytes + 2 * e.micro_batch.read_bytes) / 6.5e9 + e.step.write_bytes / 3.5e9)


def test_optimizer_only_on_nvme_leaves_the_parameters_out():
    e = estimate_nvme(NvmeSetup(FULL, sub_group_size=3_000_000, max_in_cpu=5_000_000, params_on_nvme=False))
    assert e.host_parts == {"optimizer_swap_buffers": 4 * 4_194_304 * 4, "grad_partitions": 8_391_680 * 2}
    assert e.nvme_bytes_per_node == 3 * 4 * 8_391_680 + 4 * 8_388_608
    assert e.micro_batch == NvmeTraffic(0, 0) and e.step.read_bytes == e.step.write_bytes == 134_254_592
    assert e.param_buffer_size == 0


# B: LoRA on 2 nodes x 2 GPUs (ZeRO-3 over 4). A frozen 2 Mi embedding, two frozen 1 Mi linears, two 4096-element
# norms; four 16 Ki-element adapters.
LORA = ZeroTensors(trainable=((16_384, 4),), frozen=((2_097_152, 1), (1_048_576, 2), (4096, 2)),
                   input_embedding=2_097_152)
B = NvmeSetup(LORA, partition_size=4, ranks_per_node=2)


def test_lora_two_nodes_by_hand():
    # per rank: embedding 524,288 elements (bf16 1 MiB: swapped); linears 262,144 and norms 1024 (host RAM);
    # adapters 4 x 4096 = 16,384 elements: one sub-group of 64 KiB fp32, too small to swap, so in memory
    e = estimate_nvme(B)
    per_rank = {
        "optimizer_swap_buffers": 4 * 16_384 * 4,  # allocated even though nothing is swapped
        "grad_partitions": 16_384 * 2,
        "in_memory_optimizer": 16_384 * 4 * 4,  # fp32 master, m, v and fp32 gradient
        "param_swap_buffers": 5 * 524_288 * 2,
        "trainable_params_in_cpu": 16_384 * 2,
        "small_param_partitions": (2 * 262_144 + 2 * 1024) * 2,
    }
    assert e.host_parts == {k: 2 * v for k, v in per_rank.items()}
    assert e.host_bytes_per_node == 2 * 6_885_376
    assert e.nvme_parts == {"params": 2 * 524_288 * 2}
    assert e.step == NvmeTraffic(0, 0)
    # the forward reads the embedding's partition; the backward never fetches a frozen input embedding
    assert e.micro_batch == NvmeTraffic(read_bytes=2 * 524_288 * 2, write_bytes=0)


def test_a_lora_backward_reads_the_frozen_base_once_or_twice_under_checkpointing():
    base = ZeroTensors(trainable=((16_384, 4),), frozen=((2_097_152, 1), (4_194_304, 3)), input_embedding=2_097_152)
    files = 2 * 2_097_152 + 3 * 2 * 4_194_304  # one GPU: every frozen tensor is one swap file
    layers = 3 * 2 * 4_194_304
    assert estimate_nvme(NvmeSetup(base)).micro_batch.read_bytes == files + layers
    assert estimate_nvme(NvmeSetup(base, recompute=True)).micro_batch.read_bytes == files + 2 * layers


def test_fp32_adapters_double_only_the_flat_trainable_buffer():
    e2, e4 = estimate_nvme(B), estimate_nvme(NvmeSetup(LORA, partition_size=4, ranks_per_node=2, trainable_bytes=4))
    assert e4.host_parts["trainable_params_in_cpu"] == 2 * e2.host_parts["trainable_params_in_cpu"]
    assert e4.host_bytes_per_node - e2.host_bytes_per_node == e2.host_parts["trainable_params_in_cpu"]


def test_io_alignment_pads_swap_files():
    # 600,000 bf16 elements (1.14 MiB): a file of ceil(600,000 / 512) x 512 elements
    s = NvmeSetup(ZeroTensors(trainable=(), frozen=((600_000, 1),)))
    assert estimate_nvme(s).nvme_parts == {"params": 600_064 * 2}
    assert param_buffer_elements(s) == 600_064


LLAMA3_8B = ModelSpec(name="llama3-8b", arch="dense", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      layer_types=("dense",) * 32)


def test_the_tensors_add_up_to_the_parameter_counts():
    total = count_params(LLAMA3_8B).total
    full = zero_tensors(LLAMA3_8B)
    assert full.trainable_params == total == 8_030_261_248 and full.frozen_params == 0
    lora = zero_tensors(LLAMA3_8B, make_finetune("lora", lora_rank=16))
    assert lora.trainable_params == 41_943_040  # PEFT's count for Llama-3-8B, r=16, all-linear
    assert lora.frozen_params == total
    assert max(n for n, _ in full.trainable) == 128256 * 4096  # the embedding and the LM head


def test_llama3_8b_on_one_gpu_needs_a_buffer_the_size_of_its_embedding():
    e = estimate_nvme(NvmeSetup(zero_tensors(LLAMA3_8B)))
    assert e.param_buffer_size == 525_336_576  # DeepSpeed's 1e8 default would assert
    # fp32 master + m + v on NVMe: 12 bytes a parameter, give or take alignment
    assert e.nvme_parts["optimizer_states"] == pytest.approx(12 * 8_030_261_248, rel=1e-4)


def test_qlora_and_moe_are_refused():
    with pytest.raises(ValueError, match="4-bit"):
        zero_tensors(LLAMA3_8B, make_finetune("qlora"))
    with pytest.raises(ValueError, match="MoE"):
        zero_tensors(preset_spec("b1", "moe"))


@pytest.mark.parametrize("arch", ["dense", "mod", "hybrid"])
def test_every_preset_s_tensors_add_up(arch):
    for name in PRESETS:
        spec = preset_spec(name, arch)
        if spec.is_moe:
            continue
        assert zero_tensors(spec).trainable_params == count_params(spec).total, (name, arch)


def test_the_default_drive_states_its_source():
    assert (DEFAULT_DRIVE.read_gbps, DEFAULT_DRIVE.write_gbps) == (6.5, 3.5) and "PM9A3" in DEFAULT_DRIVE.source
    d = NvmeDrive(read_gbps=2.0, write_gbps=1.0, source="test")
    assert NvmeTraffic(read_bytes=4 * GB, write_bytes=3 * GB).seconds(d) == pytest.approx(2.0 + 3.0)


# Measured: a real DeepSpeed 0.19.8 ZeRO-3 run on the CPU (gloo, one rank, bf16, torch AdamW, our ds_config from
# ds_config/nvme.py, transformers' LlamaForCausalLM built under zero.Init, PEFT LoRA r=16 all-linear added after it),
# three steps each. Host bytes: the sizes of the buffers DeepSpeed allocated, read off its optimizer and swapper
# objects; NVMe: the swap files on disk; traffic: the bytes of every aio read/write it submitted, the third step.
TINY = ModelSpec(name="tiny", arch="dense", vocab_size=4096, hidden_size=512, intermediate_size=1024,
                 num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
                 layer_types=("dense",) * 3)


def test_a_real_full_finetune_allocated_and_wrote_what_we_count():
    e = estimate_nvme(NvmeSetup(zero_tensors(TINY)))
    assert e.host_bytes_per_node == 262_215_680 and e.nvme_bytes_per_node == 210_806_784
    assert e.step == NvmeTraffic(192_980_992, 192_980_992) and e.micro_batch == NvmeTraffic(0, 0)
    # 3e6 trainable elements in host RAM, tiles of 2e6: two thirds of the 16-bit partitions live on NVMe
    spill = estimate_nvme(NvmeSetup(zero_tensors(TINY), max_in_cpu=3_000_000, sub_group_size=2_000_000))
    assert spill.host_bytes_per_node == 123_482_496 and spill.nvme_bytes_per_node == 210_806_784
    assert spill.step == NvmeTraffic(192_980_992, 206_612_480)
    # the first step's forward and backward read 13,631,488 bytes each; later steps' prefetching read 19,922,944
    # in all: the count is the first step's, an upper bound
    assert spill.micro_batch.read_bytes == 2 * 13_631_488


def test_a_real_lora_run_allocated_and_read_what_we_count():
    tensors = zero_tensors(TINY, make_finetune("lora", lora_rank=16))
    e = estimate_nvme(NvmeSetup(tensors, trainable_bytes=4))  # PEFT's adapters stayed fp32
    assert e.host_bytes_per_node == 36_461_568 and e.nvme_bytes_per_node == 22_839_296
    assert e.step == NvmeTraffic(5_013_504, 5_013_504)
    assert e.micro_batch.read_bytes == 17_825_792 + 13_631_488  # forward; backward without the embedding
    ckpt = estimate_nvme(NvmeSetup(tensors, trainable_bytes=4, recompute=True))
    assert ckpt.micro_batch.read_bytes == 17_825_792 + 27_262_976
    only = estimate_nvme(NvmeSetup(tensors, trainable_bytes=4, params_on_nvme=False))
    assert only.host_bytes_per_node == 7_520_256 and only.nvme_bytes_per_node == 5_013_504
