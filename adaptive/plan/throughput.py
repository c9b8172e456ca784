"""Training FLOPs, predicted step time, tokens/s, time and cost. Estimates, and labelled as such.

Step time = compute / utilisation, then communication DeepSpeed cannot hide, then the CPU side of
offload. Compute uses the GPU's stated MFU assumption (gpus.py), overridable with --mfu.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from adaptive.plan.gpus import GPU
from adaptive.plan.memory import TrainSetup
from adaptive.plan.blocks import block_type
from adaptive.plan.params import count_params, expert_params, layer_params, mod_router_params
from adaptive.plan.presets import ModelSpec

# Stated assumptions (each one is printed with the plan in the JSON `assumptions` block).
INTERNODE_GBPS_PER_GPU = 25.0  # 200 Gb/s InfiniBand/EFA per GPU, as on typical training clusters
HOST_LINK_GBPS = 20.0  # effective PCIe bandwidth for offload copies (pinned memory)
CPU_ADAM_PARAMS_PER_S = 1.0e9  # DeepSpeed CPUAdam per node (AVX2/AVX-512, tens of cores)
ZERO3_EFFICIENCY = 0.9  # prefetch bubbles and extra kernels of ZeRO-3
PARAM_OFFLOAD_EFFICIENCY = 0.5  # ZeRO-Infinity parameter fetches stall the forward pass


@dataclass(frozen=True)
class Throughput:
    model_flops_per_token: float  # 6·N_active(matmul params) + attention, MoD-scaled
    hardware_flops_per_token: float  # + recompute under checkpointing, + padded MoE capacity slots
    utilisation: float  # fraction of peak the compute kernels reach (assumption)
    step_seconds: float  # one optimizer step
    compute_seconds: float
    comm_seconds: float  # data-parallel collectives (overlapped with compute)
    alltoall_seconds: float  # MoE expert-parallel all-to-all (not overlapped)
    offload_seconds: float  # host copies + CPU Adam per optimizer step
    tokens_per_second: float  # whole job
    mfu: float  # model FLOPs achieved / peak, whole job


@lru_cache(maxsize=1024)
def model_flops_per_token(s: ModelSpec, seq_len: int) -> float:
    """6 FLOPs per matmul parameter per token (fwd 2 + bwd 4), plus attention 12·s·width per layer.

    MoE counts the top-k experts; a MoD-routed block runs for a fraction c of tokens, and its
    attention spans ceil(c·s) tokens. The input embedding is a lookup and costs nothing.
    """
    width = s.num_attention_heads * s.head_dim
    flops = 6.0 * s.vocab_size * s.hidden_size  # LM head (tied or not)
    for t in s.layer_types:
        _, active, _ = layer_params(s, t)
        matmul = active - 2 * s.hidden_size  # RMSNorm weights do no matmul
        if block_type(t).routed:
            k = math.ceil(s.mod_capacity * seq_len)
            frac = k / seq_len
            router = mod_router_params(s)
            flops += 6.0 * router + frac * 6.0 * (matmul - router) + frac * 12.0 * k * width
        else:
            flops += 6.0 * matmul + 12.0 * seq_len * width
    return flops


def recompute_fraction(s: ModelSpec, checkpointing: bool | str) -> float:
    """Share of the layers' forward that checkpointing runs again: 1 (full), 1/N of the layers (every:N,
    ceil(L/N) of L), or the MLP half's share of a layer's matmul weights ("mlp"; attention scores
    ignored, MoE counted at its active experts)."""
    if isinstance(checkpointing, bool):
        return 1.0 if checkpointing else 0.0
    if checkpointing == "off":
        return 0.0
    if checkpointing == "full":
        return 1.0
    if checkpointing.startswith("every:"):
        n = int(checkpointing.split(":")[1])
        layers = len(s.layer_types)
        return math.ceil(layers / n) / layers
    h, q, kv = s.hidden_size, s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    attention = h * (2 * q + 2 * kv)
    mlp = 3 * h * (s.moe_intermediate_size * s.num_experts_per_tok if s.is_moe else s.intermediate_size)
    return mlp / (mlp + attention)


@lru_cache(maxsize=4096)
def hardware_flops_per_token(s: ModelSpec, seq_len: int, checkpointing: bool | str, capacity_factor: float) -> float:
    """FLOPs the GPU really runs: MoE experts run on k·cf capacity slots per token, and checkpointing
    recomputes the layers' forward (a third of their training FLOPs) by `recompute_fraction`."""
    flops = model_flops_per_token(s, seq_len)
    if s.is_moe and capacity_factor > 1.0:
        pad = (capacity_factor - 1.0) * s.num_experts_per_tok * 6.0 * expert_params(s)
        flops += pad * s.num_moe_layers
    fraction = recompute_fraction(s, checkpointing)
    if fraction:
        layers = flops - 6.0 * s.vocab_size * s.hidden_size
        flops += fraction * layers / 3.0
    return flops


def _collective_gbps(gpu: GPU, setup: TrainSetup) -> float:
    return gpu.link_gbps if setup.num_nodes == 1 else min(gpu.link_gbps, INTERNODE_GBPS_PER_GPU)


def estimate_throughput(setup: TrainSetup, gpu: GPU, grad_accum: int, mfu: float | None = None) -> Throughput:
    s = setup.spec
    counts = count_params(s)
    n = setup.world_size
    b = setup.bytes_per_param
    tokens_step_gpu = setup.tokens_per_micro_batch * grad_accum
    model_fpt = model_flops_per_token(s, setup.seq_len)
    hw_fpt = hardware_flops_per_token(s, setup.seq_len, setup.checkpointing, setup.capacity_factor)
    util = mfu if mfu is not None else gpu.mfu
    if setup.zero_stage == 3:
        util *= ZERO3_EFFICIENCY
    if setup.offload_params:
        util *= PARAM_OFFLOAD_EFFICIENCY
    compute = tokens_step_gpu * hw_fpt / (util * gpu.peak_tflops * 1e12)

    # Data-parallel collectives per optimizer step (ring: each GPU moves (n-1)/n of the buffer).
    comm = 0.0
    if n > 1:
        ring = (n - 1) / n
        p16 = (counts.total - counts.expert + counts.expert / setup.ep_size) * b
        if setup.zero_stage in (0, 1):
            volume = 2 * ring * p16  # one all-reduce of 16-bit grads at the boundary
        elif setup.zero_stage == 2:
            volume = ring * p16 * grad_accum + ring * p16  # reduce-scatter per micro-step + all-gather
        else:
            # all-gathers in fwd, bwd (and recompute; selective: its share)
            passes = 2 + recompute_fraction(s, setup.checkpointing)
            volume = (passes + 1) * ring * p16 * grad_accum  # + reduce-scatter
        comm = volume / (_collective_gbps(gpu, setup) * 1e9)

    alltoall = 0.0
    if s.is_moe and setup.ep_size > 1:
        slots = setup.tokens_per_micro_batch * s.num_experts_per_tok * setup.capacity_factor
        per_layer = 4 * slots * s.hidden_size * b * (setup.ep_size - 1) / setup.ep_size  # 2 fwd + 2 bwd
        passes = 1.0 + 0.5 * recompute_fraction(s, setup.checkpointing)
        # DeepSpeed builds expert-parallel groups from consecutive ranks: within a node while they fit
        intra_node = setup.ep_size <= setup.gpus_per_node
        gbps = gpu.link_gbps if intra_node else _collective_gbps(gpu, setup)
        alltoall = passes * per_layer * s.num_moe_layers * grad_accum / (gbps * 1e9)

    offload = 0.0
    if setup.offload_optimizer:
        partition = counts.total / n
        copies = partition * (b + b) / (HOST_LINK_GBPS * 1e9)  # grads down, updated params up
        adam = counts.total / setup.num_nodes / CPU_ADAM_PARAMS_PER_S
        offload = copies + adam

    step = max(compute, comm) + alltoall + offload
    tokens_per_second = tokens_step_gpu * n / step
    peak = gpu.peak_tflops * 1e12 * n
    return Throughput(
        model_flops_per_token=model_fpt,
        hardware_flops_per_token=hw_fpt,
        utilisation=util,
        step_seconds=step,
        compute_seconds=compute,
        comm_seconds=comm,
        alltoall_seconds=alltoall,
        offload_seconds=offload,
        tokens_per_second=tokens_per_second,
        mfu=tokens_per_second * model_fpt / peak,
    )


def train_hours(tokens: float, tokens_per_second: float) -> float:
    return tokens / tokens_per_second / 3600.0


def cost_usd(hours: float, num_gpus: int, price_per_gpu_hour: float) -> float:
    return hours * num_gpus * price_per_gpu_hour


__all__ = ["Throughput", "model_flops_per_token", "hardware_flops_per_token", "estimate_throughput",
           "train_hours", "cost_usd"]
