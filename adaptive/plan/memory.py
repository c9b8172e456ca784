"""Per-GPU memory of one DeepSpeed training step, in bytes, part by part.

Model states follow DeepSpeed's own accounting (its `estimate_zero{2,3}_model_states_mem_needs`,
checked in tests/plan/test_memory_vs_deepspeed.py). Activations are counted tensor by tensor for
our blocks (see activations.py). Everything else is a stated allowance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from adaptive.plan.activations import activation_bytes, logits_bytes, transient_bytes
from adaptive.plan.params import ParamCounts, count_params
from adaptive.plan.presets import ModelSpec

GiB = 2**30

# Allowances a plan adds on top of what tensors need.
CUDA_CONTEXT_BYTES = int(0.75 * GiB)  # CUDA context, cuBLAS/cuDNN workspaces, NCCL: ~0.5-1 GiB seen
FRAGMENTATION = 0.05  # caching-allocator fragmentation as a fraction of allocated bytes

# DeepSpeed buckets we write into every ds_config.json (emit.py reads these too).
REDUCE_BUCKET_ELEMENTS = 200_000_000
ALLGATHER_BUCKET_ELEMENTS = 200_000_000
STAGE3_PREFETCH_ELEMENTS = 50_000_000
STAGE3_MAX_LIVE_PARAMETERS = 1_000_000_000

# CPU-side buffer factor DeepSpeed's estimators apply to host memory.
HOST_BUFFER_FACTOR = 1.5


@dataclass(frozen=True)
class TrainSetup:
    """One candidate configuration, as the memory and throughput models see it."""

    spec: ModelSpec
    seq_len: int
    micro_batch_size: int
    zero_stage: int
    offload_optimizer: bool
    offload_params: bool
    gradient_checkpointing: bool
    gpus_per_node: int = 1
    num_nodes: int = 1
    ep_size: int = 1
    capacity_factor: float = 1.0
    bytes_per_param: int = 2  # bf16 or fp16 weights and activations

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.num_nodes

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch_size


@dataclass(frozen=True)
class MemoryEstimate:
    parts: dict[str, int]  # part -> bytes per GPU; they sum to peak_gpu_bytes
    peak_gpu_bytes: int
    host_bytes_per_node: int  # CPU RAM the offloaded states need on each node (0 without offload)

    @property
    def peak_without_context_bytes(self) -> int:
        return self.peak_gpu_bytes - self.parts["cuda_context"]


def model_state_bytes(setup: TrainSetup, counts: ParamCounts | None = None) -> dict[str, int]:
    """16-bit params, gradients and optimizer states per GPU, and the ZeRO-3 live-layer buffer.

    Byte multipliers per parameter (DeepSpeed's estimators and ZeRO paper): 2 for 16-bit params;
    ZeRO-2 grads 6 = 2 (16-bit) + 4 (fp32 partition); optimizer 12 = fp32 master 4 + Adam m 4 + v 4.
    ZeRO-3 keeps 18 bytes/param in all (DeepSpeed's figure): params 2, grads 4, optimizer 12, each
    over N, plus 4 bytes x the largest layer gathered at once.
    Expert parameters live on ep_size-way shards: each GPU holds E/ep experts, and their ZeRO
    partition runs over the expert-data-parallel group of world/ep GPUs.
    """
    c = counts or count_params(setup.spec)
    n = setup.world_size
    ep = setup.ep_size
    dense = c.total - c.expert
    # 16-bit copies held per GPU: all dense params, 1/ep of the experts
    local = dense + c.expert / ep
    # ZeRO partitions: dense over n GPUs, experts (already /ep) over n/ep expert-DP ranks -> c.expert/n
    partition = dense / n + c.expert / n
    stage = setup.zero_stage
    live = 0.0
    if stage == 0:
        params, grads, optim = 2 * local, 6 * local, 12 * local
    elif stage == 1:
        params, grads, optim = 2 * local, 2 * local + 4 * partition, 12 * partition
    elif stage == 2:
        params, grads, optim = 2 * local, 6 * partition, 12 * partition
    elif stage == 3:
        params, grads, optim = 2 * partition, 4 * partition, 12 * partition
        live = 4 * c.largest_layer
    else:
        raise ValueError(f"zero_stage must be 0-3, got {stage}")
    if setup.offload_optimizer:
        # grads go to the CPU in buckets; fp32 master, moments and grads live in host RAM
        grads, optim = 0.0, 0.0
    if setup.offload_params:
        params = 0.0  # ZeRO-3 fetches each layer from host RAM into the live buffer
    return {"params": int(params), "grads": int(grads), "optimizer": int(optim),
            "zero3_live_params": int(live)}


def host_bytes_per_node(setup: TrainSetup, counts: ParamCounts | None = None) -> int:
    """Host RAM for offloaded states, DeepSpeed's estimator formulas (zero_init=True for ZeRO-3)."""
    if not (setup.offload_optimizer or setup.offload_params):
        return 0
    c = counts or count_params(setup.spec)
    p = c.total
    if setup.zero_stage == 3:
        per_param = 18 if setup.offload_params else 16
        return int(p * per_param / setup.num_nodes * HOST_BUFFER_FACTOR)
    # ZeRO-1/2 with optimizer offload: max(4 bytes x GPUs, 16) per param on the node
    return int(p * max(4 * setup.world_size, 16) * HOST_BUFFER_FACTOR / setup.num_nodes)


def comm_buffer_bytes(setup: TrainSetup, counts: ParamCounts | None = None) -> int:
    """DeepSpeed's communication buckets, capped by the size of what they carry."""
    c = counts or count_params(setup.spec)
    b = setup.bytes_per_param
    if setup.zero_stage in (1, 2):
        # gradient reduce bucket (16-bit) + parameter all-gather bucket after the step
        reduce = min(REDUCE_BUCKET_ELEMENTS, c.total) * b
        gather = min(ALLGATHER_BUCKET_ELEMENTS, c.total) * b if setup.world_size > 1 else 0
        return int(reduce + gather)
    if setup.zero_stage == 3:
        return int(min(REDUCE_BUCKET_ELEMENTS, c.total) * b + min(STAGE3_PREFETCH_ELEMENTS, c.total) * b)
    return 0


def estimate_memory(setup: TrainSetup) -> MemoryEstimate:
    """The per-GPU peak of a training step and its parts."""
    counts = count_params(setup.spec)
    parts = model_state_bytes(setup, counts)
    parts["activations"] = activation_bytes(setup.spec, setup.seq_len, setup.micro_batch_size,
                                            setup.gradient_checkpointing, setup.capacity_factor,
                                            setup.ep_size)
    parts["logits_and_loss"] = logits_bytes(setup.spec, setup.seq_len, setup.micro_batch_size)
    parts["backward_transient"] = transient_bytes(setup.spec, setup.seq_len, setup.micro_batch_size,
                                                  setup.gradient_checkpointing, setup.capacity_factor)
    parts["comm_buckets"] = comm_buffer_bytes(setup, counts)
    allocated = sum(parts.values())
    parts["fragmentation"] = int(math.ceil(FRAGMENTATION * allocated))
    parts["cuda_context"] = CUDA_CONTEXT_BYTES
    return MemoryEstimate(parts=parts, peak_gpu_bytes=sum(parts.values()),
                          host_bytes_per_node=host_bytes_per_node(setup, counts))
