"""Training FLOPs, predicted step time, tokens/s, time and cost. Estimates, and labelled as such.

Step time = compute + the communication DeepSpeed cannot hide behind it + MoE all-to-all + the CPU
side of offload.
- Compute: each operation of a micro-batch timed by its own shape (op_times.py: matmuls, attention,
  memory-bound work, the launch floor; the optimizer step), recompute included. `--mfu` replaces that model by
  hardware FLOPs at one given utilisation; `--calibrate RUN_DIR` scales the modelled compute by what a real run
  measured. The MFU reported is always model FLOPs over peak.
- Communication overlaps with compute as DeepSpeed runs it (`overlap_comm`, ZeRO-3 prefetch):
  gradient reduction hides behind the backward pass that produces the gradients, ZeRO-3's parameter
  all-gathers behind the forward/backward they feed; only the excess, the last bucket's reduction
  after backward ends and ZeRO-1/2's all-gather of updated parameters after the step are exposed.
- Bandwidths: the catalog's intra-node link; across nodes the per-GPU InfiniBand/Ethernet share of the
  vendors' system specs (hardware/figures.py); collectives reach NCCL_BUS_EFFICIENCY of the line rate.
"""

from __future__ import annotations

import math
from functools import lru_cache

from adaptive.plan.architecture.blocks import block_type
from adaptive.plan.hardware.figures import NCCL_BUS_EFFICIENCY
from adaptive.plan.hardware.gpus import GPU, figures
from adaptive.plan.estimate.memory import TrainSetup, nvme_estimate, reduce_bucket_elements, trained_counts
from adaptive.plan.estimate.op_times import (STACKS, OpTimes, local_params, micro_batch_times, optimizer_times,
                                             rates_of)
from adaptive.plan.estimate.pipeline import bubble_fraction, p2p_bytes_per_micro_batch
from adaptive.plan.estimate.pipeline import partition as stages_of
from adaptive.plan.estimate.parallel import (QGZ_BYTES_PER_PARAM, QWZ_BYTES_PER_PARAM, expert_tp_bytes_per_moe_layer,
                                    sp_alltoall_bytes_per_layer, tp_allreduce_bytes_per_layer)
from adaptive.plan.architecture.params import count_params, expert_params, layer_params, mod_router_params
from adaptive.plan.architecture.presets import ModelSpec
from adaptive.plan.finetune.method import Finetune
from adaptive.plan.finetune.roles import param_roles
from adaptive.record import record

# Stated assumptions (each one is printed with the plan in the JSON `assumptions` block).
HOST_LINK_GBPS = 20.0  # effective PCIe bandwidth for offload copies (pinned memory)
# DeepSpeed CPUAdam, parameters per second per node, offload copies included: measured 0.34e9 on 2 x Xeon
# 8358 with 8 ranks (HF Llama-7B, DeepSpeed 0.14.2: offload added 20.1 s per step for 6.74B params;
# gist chenyaofo/d4cd6a20ab4b95cb3a49491747e2139a, rows ZeRO-2 ckpt with and without optimizer offload)
CPU_ADAM_PARAMS_PER_S = 0.34e9
PARAM_OFFLOAD_EFFICIENCY = 0.5  # ZeRO-Infinity parameter fetches stall the forward pass


@record
class Throughput:
    """A candidate's estimated speed, step time by part, and MFU."""

    model_flops_per_token: float  # 6·N_active(matmul params) + attention, MoD-scaled
    hardware_flops_per_token: float  # + recompute under checkpointing, + padded MoE capacity slots
    utilisation: float  # hardware FLOPs over compute time and peak: what the per-op model implies, or --mfu
    step_seconds: float  # one optimizer step
    compute_seconds: float
    comm_seconds: float  # data-parallel collectives that cannot hide behind compute
    alltoall_seconds: float  # MoE expert-parallel all-to-all (not overlapped)
    offload_seconds: float  # host copies + CPU Adam per optimizer step
    tokens_per_second: float  # whole job
    mfu: float  # model FLOPs achieved / peak, whole job
    comm_total_seconds: float = 0.0  # all data-parallel collective time, hidden or not
    tp_allreduce_seconds: float = 0.0  # AutoTP's per-layer all-reduces (critical path)
    sp_alltoall_seconds: float = 0.0  # Ulysses' per-layer all-to-alls (critical path)
    pipeline_bubble_seconds: float = 0.0  # the (p - 1) idle slots of DeepSpeed's 1F1B schedule
    pipeline_p2p_seconds: float = 0.0  # blocking activation/gradient sends between stages (critical path)
    pipeline_bubble_fraction: float = 0.0  # (p - 1)/(m + p - 1)
    # compute_seconds by kind of work (op_times.py), per step; all zero when --mfu gave the utilisation instead
    matmul_seconds: float = 0.0
    attention_seconds: float = 0.0
    memory_bound_seconds: float = 0.0  # norms, activations, RoPE, loss, dispatch, gradients, optimizer step
    launch_seconds: float = 0.0  # the launch floor's excess over the kernels' own time
    kernels_per_step: float = 0.0
    optimizer_seconds: float = 0.0  # the optimizer step on the GPU, in compute_seconds (memory-bound)


@lru_cache(maxsize=1024)
def model_flops_per_token(s: ModelSpec, seq_len: int, finetune: Finetune | None = None) -> float:
    """6 FLOPs per matmul parameter per token (fwd 2 + bwd 4), plus attention 12·s·width per layer.

    MoE counts the top-k experts; a MoD-routed block runs for a fraction c of tokens, and its
    attention spans ceil(c·s) tokens. The input embedding is a lookup and costs nothing. LoRA and QLoRA need no
    weight gradient for their frozen base: 4 FLOPs per frozen matmul parameter, 6 per adapter parameter.
    """
    full = 6.0 * s.vocab_size * s.hidden_size + sum(layer_flops_per_token(s, seq_len))  # LM head (tied or not)
    if finetune is None or not finetune.adapted:
        return full
    attention = _attention_flops_per_token(s, seq_len)
    return 4.0 * (full - attention) / 6.0 + 6.0 * param_roles(s, finetune).adapter + attention


def _attention_flops_per_token(s: ModelSpec, seq_len: int) -> float:
    """The attention matmuls' 12·s·width per layer (a fine-tuned decoder has no MoD-routed block)."""
    return 12.0 * seq_len * s.num_attention_heads * s.head_dim * s.num_hidden_layers


@lru_cache(maxsize=1024)
def layer_flops_per_token(s: ModelSpec, seq_len: int) -> tuple[float, ...]:
    """Each decoder layer's model FLOPs per token (model_flops_per_token's terms)."""
    width = s.num_attention_heads * s.head_dim
    out = []
    for t in s.layer_types:
        _, active, _ = layer_params(s, t)
        matmul = active - 2 * s.hidden_size  # RMSNorm weights do no matmul
        if block_type(t).routed:
            k = math.ceil(s.mod_capacity * seq_len)
            frac = k / seq_len
            router = mod_router_params(s)
            out.append(6.0 * router + frac * 6.0 * (matmul - router) + frac * 12.0 * k * width)
        else:
            out.append(6.0 * matmul + 12.0 * seq_len * width)
    return tuple(out)


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
def hardware_flops_per_token(s: ModelSpec, seq_len: int, checkpointing: bool | str, capacity_factor: float,
                             finetune: Finetune | None = None) -> float:
    """FLOPs the GPU really runs: MoE experts run on k·cf capacity slots per token, and checkpointing
    recomputes the layers' forward (a third of their training FLOPs) by `recompute_fraction`."""
    if finetune is not None and finetune.adapted:  # the forward is the same; the adapters' forward comes on top
        forward = ((model_flops_per_token(s, seq_len) - 6.0 * s.vocab_size * s.hidden_size) / 3.0
                   + 2.0 * param_roles(s, finetune).adapter)
        return model_flops_per_token(s, seq_len, finetune) + recompute_fraction(s, checkpointing) * forward
    flops = model_flops_per_token(s, seq_len)
    if s.is_moe and capacity_factor > 1.0:
        pad = (capacity_factor - 1.0) * s.num_experts_per_tok * 6.0 * expert_params(s)
        flops += pad * s.num_moe_layers
    fraction = recompute_fraction(s, checkpointing)
    if fraction:
        layers = flops - 6.0 * s.vocab_size * s.hidden_size
        flops += fraction * layers / 3.0
    return flops


def collective_gbps(gpu: GPU, setup: TrainSetup, consecutive: int | None = None) -> float:
    """Bus bandwidth a collective reaches, GB/s per GPU: the intra-node link inside one node, else the
    slower of it and the per-GPU inter-node share, at NCCL_BUS_EFFICIENCY. `consecutive`: a group of that
    many consecutive ranks (an SP group), inside a node when it fits in one; by default the ZeRO group,
    which spans every node (AutoTP's groups are the consecutive ranks, the data-parallel ones stride them)."""
    inside = setup.num_nodes == 1 or (consecutive is not None and consecutive <= setup.gpus_per_node)
    line = gpu.link_gbps if inside else min(gpu.link_gbps, figures(gpu.name).inter_node_gbps)
    return line * NCCL_BUS_EFFICIENCY


def intra_node_gbps(gpu: GPU) -> float:
    return gpu.link_gbps * NCCL_BUS_EFFICIENCY


def data_parallel_comm(setup: TrainSetup, gpu: GPU, grad_accum: int, fwd_micro: float,
                       bwd_micro: float) -> tuple[float, float]:
    """(exposed, total) seconds of ZeRO/data-parallel collectives per optimizer step.

    Ring collectives move (n-1)/n of the buffer per GPU, over the ZeRO group (world/tp GPUs: data and
    sequence parallel ranks). What overlaps, as DeepSpeed runs it:
    ZeRO-0/1 all-reduce the gradients at the accumulation boundary during the last micro-batch's
    backward; ZeRO-2 reduce-scatters during every backward; ZeRO-3 all-gathers each layer's
    parameters ahead of its forward and backward (and recompute) and reduce-scatters during backward.
    The last bucket's reduction starts after backward ends, and ZeRO-1/2 all-gather the updated
    parameters after the optimizer step: both exposed.
    ZeRO++ (ZeRO-3): hpZ's backward gathers run inside the node over zero_hpz GPUs; qwZ gathers int8
    (QWZ_BYTES_PER_PARAM instead of 2); qgZ reduce-scatters int4 in two all-to-all stages, inside the node
    first, then across nodes (ZeRO++ paper, arXiv 2306.10209, Table 1: 0.25M across nodes instead of M).
    """
    n = setup.zero_group_size
    if n == 1:
        return 0.0, 0.0
    counts = trained_counts(setup, count_params(setup.spec))
    b = setup.bytes_per_param
    ring = (n - 1) / n
    local = local_params(setup) * setup.pp_size  # the whole model's share (a pipeline plans its comm elsewhere)
    p16 = local * b
    gbps = collective_gbps(gpu, setup) * 1e9
    bucket = min(setup.reduce_bucket_elements or reduce_bucket_elements(counts), counts.total) * b
    one = ring * p16 / gbps  # one reduce-scatter or all-gather of the 16-bit model (of what trains)
    last_bucket = ring * bucket / gbps
    if setup.zero_stage in (0, 1):
        allreduce = 2 * one
        return max(0.0, allreduce - bwd_micro) + 2 * last_bucket, allreduce
    if setup.zero_stage == 2:
        exposed = grad_accum * max(0.0, one - bwd_micro) + last_bucket + one
        return exposed, grad_accum * one + one
    gather = one * (QWZ_BYTES_PER_PARAM / b if setup.zero_quantized_weights else 1.0)
    roles = param_roles(setup.spec, setup.finetune)
    if roles.frozen:  # ZeRO-3 gathers a fine-tune's frozen base too (its NF4 codes as they are stored)
        gather += ring * (2 * roles.frozen_16bit + roles.nf4_packed_bytes) / gbps
    bwd_gather = gather
    if setup.zero_hpz > 1:
        h = setup.zero_hpz
        bwd_gather = (h - 1) / h * p16 / (intra_node_gbps(gpu) * 1e9)
        if setup.zero_quantized_weights:
            bwd_gather *= QWZ_BYTES_PER_PARAM / b
    scatter = one
    if setup.zero_quantized_gradients and setup.num_nodes > 1:
        g = setup.gpus_per_node
        inside = (g - 1) / g * local * QGZ_BYTES_PER_PARAM / (intra_node_gbps(gpu) * 1e9)
        scatter = inside + one * QGZ_BYTES_PER_PARAM / b
    gathers_bwd = 1 + recompute_fraction(setup.spec, setup.checkpointing)  # backward (and recompute) gathers
    per_micro = max(0.0, gather - fwd_micro) + max(0.0, gathers_bwd * bwd_gather + scatter - bwd_micro)
    last = last_bucket * (scatter / one)
    return grad_accum * per_micro + last, grad_accum * (gather + gathers_bwd * bwd_gather + scatter)


def model_parallel_comm(setup: TrainSetup, gpu: GPU, grad_accum: int) -> tuple[float, float]:
    """(AutoTP all-reduce, Ulysses all-to-all) seconds per optimizer step. Both sit on the critical
    path: each layer waits for them (AutoTP's tp_overlap_comm is off by default and we emit it off;
    Ulysses' all-to-alls bracket attention). Recompute repeats the forward's share."""
    s = setup.spec
    layers = s.num_hidden_layers
    tokens = setup.tokens_per_micro_batch  # whole micro-batch: each TP rank holds all of its tokens
    redo = 1.0 + 0.5 * recompute_fraction(s, setup.checkpointing)  # forward half repeated
    tp_s = sp_s = 0.0
    if setup.tp_size > 1:
        t = setup.tp_size
        volume = tp_allreduce_bytes_per_layer(tokens, s.hidden_size, setup.bytes_per_param) * 2 * (t - 1) / t
        volume *= layers
        if s.is_moe:  # the experts are tensor-parallel too
            volume += s.num_moe_layers * expert_tp_bytes_per_moe_layer(tokens, s, setup.capacity_factor, t,
                                                                        setup.bytes_per_param)
        tp_s = redo * volume * grad_accum / (intra_node_gbps(gpu) * 1e9)
    if setup.sp_size > 1:
        p = setup.sp_size
        local = tokens // p
        volume = sp_alltoall_bytes_per_layer(s, local, p, setup.bytes_per_param) * (p - 1) / p
        gbps = intra_node_gbps(gpu) if p <= setup.gpus_per_node else collective_gbps(gpu, setup, p)
        sp_s = redo * volume * layers * grad_accum / (gbps * 1e9)
    return tp_s, sp_s


def slowest_stage_share(s: ModelSpec, seq_len: int, pp: int, hw_layers: float, hw_total: float) -> float:
    """The slowest pipeline stage's share of a token's hardware FLOPs: its blocks' share of the layers' FLOPs
    (recompute included, `hw_layers`), plus the head's on the last stage. The embedding is a lookup."""
    per_layer = layer_flops_per_token(s, seq_len)
    layers = sum(per_layer)
    head = hw_total - hw_layers

    def flops(st) -> float:
        return hw_layers * sum(per_layer[st.first_block:st.stop_block]) / layers + (head if st.head else 0.0)

    return max(flops(st) for st in stages_of(s, pp)) / hw_total


def p2p_seconds_per_micro_batch(setup: TrainSetup, gpu: GPU) -> float:
    """A stage's blocking sends for one micro-batch: its activation forward and its input's gradient back, each
    1/tp per TP rank (pipe_partitioned) then all-gathered inside the TP group; on the inter-node link when the
    pipeline spans nodes (its stages are consecutive blocks of ranks, topology.py axes pipe, data, model)."""
    act = p2p_bytes_per_micro_batch(setup.spec, setup.seq_len, setup.micro_batch_size, setup.bytes_per_param)
    t = setup.tp_size
    link = gpu.link_gbps if setup.num_nodes == 1 else min(gpu.link_gbps, figures(gpu.name).inter_node_gbps)
    send = 2 * act / t / (link * NCCL_BUS_EFFICIENCY * 1e9)
    gather = 2 * act * (t - 1) / t / (intra_node_gbps(gpu) * 1e9) if t > 1 else 0.0
    return send + gather


def pipeline_allreduce_seconds(setup: TrainSetup, gpu: GPU) -> float:
    """The slowest stage's gradient reduction and ZeRO-1 parameter all-gather over its data-parallel group
    (world / (tp x pp) GPUs, strided inside the stage's consecutive ranks), after the pipeline drains."""
    n = setup.zero_group_size
    if n == 1:
        return 0.0
    st = max(stages_of(setup.spec, setup.pp_size), key=lambda x: x.params)
    local = st.params - st.expert_params + st.expert_params / setup.ep_size
    p16 = local / setup.tp_size * setup.bytes_per_param
    gbps = collective_gbps(gpu, setup, setup.world_size // setup.pp_size) * 1e9
    return 2 * (n - 1) / n * p16 / gbps


def estimate_throughput(setup: TrainSetup, gpu: GPU, grad_accum: int, mfu: float | None = None,
                        compute_scale: float = 1.0) -> Throughput:
    s = setup.spec
    n = setup.world_size
    b = setup.bytes_per_param
    tokens_step_gpu = setup.tokens_per_micro_batch * grad_accum
    model_fpt = model_flops_per_token(s, setup.seq_len, setup.finetune)
    hw_fpt = hardware_flops_per_token(s, setup.seq_len, setup.checkpointing, setup.capacity_factor, setup.finetune)
    # a model replica's tp x sp GPUs share its tokens' FLOPs (Ulysses splits attention by heads)
    hw_flops_gpu = tokens_step_gpu * hw_fpt / (setup.tp_size * setup.sp_size)
    slow = 1.0 / (PARAM_OFFLOAD_EFFICIENCY if setup.offload_params else 1.0)
    if mfu is not None:  # a given utilisation replaces the model, calibration included
        micro_ops = step_ops = OpTimes()
        micro = hw_flops_gpu / (mfu * gpu.peak_tflops * 1e12) * slow / grad_accum
        fwd_micro = micro * (model_fpt / 3) / hw_fpt  # forward = a third of the model FLOPs
    else:
        rates = rates_of(gpu)
        times = micro_batch_times(setup, rates)
        slow *= compute_scale / STACKS[setup.stack].efficiency
        micro_ops, step_ops = times.total.scaled(slow), optimizer_times(setup, rates).scaled(slow)
        micro = micro_ops.total_s
        fwd_micro = times.forward.total_s * slow
    optimizer = step_ops.total_s  # once per step, after the last micro-batch
    micro_batches = micro * grad_accum
    compute = micro_batches + optimizer
    util = hw_flops_gpu / (compute * gpu.peak_tflops * 1e12)
    comm, comm_total = data_parallel_comm(setup, gpu, grad_accum, fwd_micro, micro - fwd_micro)
    tp_comm, sp_comm = model_parallel_comm(setup, gpu, grad_accum)

    alltoall = 0.0
    if s.is_moe and setup.ep_size > 1:
        # each rank routes its own tokens: 1/sp of the sequence; TP ranks drop their duplicate tokens
        # before the all-to-all (moe/sharded_moe.py drop_tokens over the tensor-parallel group)
        slots = (setup.tokens_per_micro_batch / (setup.sp_size * setup.tp_size) * s.num_experts_per_tok
                 * setup.capacity_factor)
        per_layer = 4 * slots * s.hidden_size * b  # 2 fwd + 2 bwd, each the rank's whole dispatched tensor
        passes = 1.0 + 0.5 * recompute_fraction(s, setup.checkpointing)
        # DeepSpeed builds expert-parallel groups from consecutive data-parallel ranks (every tp-th rank), and
        # its training path runs one flat NCCL all-to-all (moe/sharded_moe.py:701, no hierarchical variant):
        # the share to peers in the node goes over NVLink while the rest crosses nodes, at the same time
        ep = setup.ep_size
        in_node = min(ep, max(1, setup.gpus_per_node // setup.tp_size))
        intra = (in_node - 1) / ep * per_layer / (intra_node_gbps(gpu) * 1e9)
        inter = (ep - in_node) / ep * per_layer / (collective_gbps(gpu, setup) * 1e9) if ep > in_node else 0.0
        alltoall = passes * max(intra, inter) * s.num_moe_layers * grad_accum

    offload = 0.0
    if setup.offload_optimizer:
        trained = param_roles(s, setup.finetune).trainable
        partition = trained / n
        copies = partition * (b + b) / (HOST_LINK_GBPS * 1e9)  # grads down, updated params up
        adam = trained / setup.num_nodes / CPU_ADAM_PARAMS_PER_S
        offload = copies + adam
    if setup.offload_device == "nvme":
        # ZeRO-Infinity: the optimizer step swaps its states in and out (no overlap: we write pipeline_read and
        # pipeline_write off), and each micro-batch reads its NVMe-resident parameters, hidden only behind compute
        nv = nvme_estimate(setup)
        params_read = grad_accum * nv.micro_batch.seconds(nv.drive)
        offload += nv.step.seconds(nv.drive) + max(0.0, params_read - micro_batches)

    bubble = p2p = 0.0
    if setup.pp_size > 1:
        # DeepSpeed's pipeline engine (pipeline.py): each slot is one micro-batch's forward and backward on the
        # slowest stage, its share of the layers' per-micro-batch times, plus the blocking sends between stages;
        # (m + p - 1) slots, then the stage's gradient all-reduce, exposed
        m, p = grad_accum, setup.pp_size
        share = slowest_stage_share(s, setup.seq_len, p, hw_fpt - 6.0 * s.vocab_size * s.hidden_size, hw_fpt)
        layer_share = max(st.blocks for st in stages_of(s, p)) / s.num_hidden_layers
        micro_batches, tp_comm, alltoall = micro_batches * share, tp_comm * layer_share, alltoall * layer_share
        micro_ops = micro_ops.scaled(share)
        compute = micro_batches + optimizer
        p2p = m * p2p_seconds_per_micro_batch(setup, gpu)
        bubble = (p - 1) / m * (micro_batches + tp_comm + alltoall + p2p)
        comm = comm_total = pipeline_allreduce_seconds(setup, gpu)
    step = compute + comm + tp_comm + sp_comm + alltoall + offload + bubble + p2p
    ops = micro_ops.scaled(grad_accum) + step_ops
    tokens_per_second = tokens_step_gpu * setup.dp_size / step
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
        comm_total_seconds=comm_total,
        tp_allreduce_seconds=tp_comm,
        sp_alltoall_seconds=sp_comm,
        pipeline_bubble_seconds=bubble,
        pipeline_p2p_seconds=p2p,
        pipeline_bubble_fraction=bubble_fraction(setup.pp_size, grad_accum),
        matmul_seconds=ops.matmul_s,
        attention_seconds=ops.attention_s,
        memory_bound_seconds=ops.memory_s,
        launch_seconds=ops.launch_s,
        kernels_per_step=ops.kernels,
        optimizer_seconds=optimizer,
    )


def train_hours(tokens: float, tokens_per_second: float) -> float:
    return tokens / tokens_per_second / 3600.0


def cost_usd(hours: float, num_gpus: int, price_per_gpu_hour: float) -> float:
    return hours * num_gpus * price_per_gpu_hour


__all__ = ["Throughput", "model_flops_per_token", "hardware_flops_per_token", "estimate_throughput",
           "train_hours", "cost_usd"]
