"""Beyond data parallelism, as DeepSpeed 0.19.8 runs it: Ulysses sequence parallel (SP), AutoTP tensor
parallel (TP) and ZeRO++ (hpZ, qwZ, qgZ). What combines, what each holds per GPU, what each sends.

The rules below are read from DeepSpeed 0.19.8's source (docs/DESIGN.md, "Parallelism DeepSpeed
combines", gives the file:line of each); a pinned combination DeepSpeed refuses, or does not compose,
is one line naming the limit. Pipeline parallelism (DeepSpeed's pipeline engine on our models as a
PipelineModule) is modelled in pipeline.py; its rules are here.
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptive.plan.architecture.presets import ModelSpec

# qwZ: int8 weights plus one fp32 scale per quantization group of ~8,000 elements
# (partition_parameters.py CUDAQuantizer.target_group_size), bytes per parameter on the wire
QWZ_BYTES_PER_PARAM = 1 + 4 / 8000
# qgZ: int4 gradients (coalesced_collectives.py all_to_all_quant_reduce, 4 bits) plus scales, per parameter
QGZ_BYTES_PER_PARAM = 0.5 + 4 / 2048
# Korthikanti et al. 2022 (arXiv 2205.05198) Table 2, tensor parallel without sequence parallel:
# s·b·h·(10 + 24/t) of a layer's 34·s·b·h; the 10 (norm inputs, residuals, dropout masks) stay replicated
TP_REPLICATED_ACTIVATION_SHARE = 10 / 34


@dataclass(frozen=True)
class Layout:
    """How one model replica spreads over GPUs: tp x sp GPUs per replica, ZeRO++ on the ZeRO-3 group."""

    tp: int = 1
    sp: int = 1
    hpz: int = 1  # zero_hpz_partition_size: 1 is off
    qwz: bool = False  # zero_quantized_weights
    qgz: bool = False  # zero_quantized_gradients
    pp: int = 1  # pipeline stages (pipeline.py)

    @property
    def degree(self) -> int:
        return self.tp * self.sp * self.pp

    @property
    def zeropp(self) -> bool:
        return self.hpz > 1 or self.qwz or self.qgz


def divisors_up_to(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def sp_heads_error(spec: ModelSpec, sp: int) -> str | None:
    """UlyssesSPAttentionHF (runtime/sequence_parallel/ulysses_sp.py:147-152): query heads divisible by
    sp, and kv heads divisible by sp or sp by kv heads (kv heads are then replicated)."""
    q, kv = spec.num_attention_heads, spec.num_key_value_heads
    if q % sp:
        return f"attention heads ({q}) must be divisible by --sp-size ({sp}) for Ulysses sequence parallelism"
    if kv % sp and sp % kv:
        return (f"key-value heads ({kv}) must divide or be divisible by --sp-size ({sp}) for Ulysses sequence "
                "parallelism")
    return None


def tp_heads_error(spec: ModelSpec, tp: int) -> str | None:
    """AutoTP splits q/k/v projections by heads; uneven shards need tp_grain_size, which training
    does not activate yet (runtime/tensor_parallel/config.py TPConfig.tp_grain_size)."""
    q, kv = spec.num_attention_heads, spec.num_key_value_heads
    if q % tp or kv % tp:
        # DeepSpeed only warns when tp exceeds the kv heads (engine.py:1048); the shards would hold no whole head
        return f"attention heads ({q}) and key-value heads ({kv}) must be divisible by --tp-size ({tp}) for AutoTP"
    if spec.hidden_size % tp or spec.intermediate_size % tp:
        return f"hidden ({spec.hidden_size}) and MLP ({spec.intermediate_size}) widths must be divisible by --tp-size ({tp})"
    return None


def layout_error(spec: ModelSpec, layout: Layout, *, world: int, gpus_per_node: int, seq_len: int,
                 zero_stage: int | None, ep_size: int | None) -> str | None:
    """Why DeepSpeed cannot run this layout, in one line; None when it can."""
    tp, sp, hpz = layout.tp, layout.sp, layout.hpz
    if layout.pp > 1 and (err := pp_error(spec, layout, world=world, zero_stage=zero_stage)):
        return err
    if world % (tp * sp):
        return f"the number of GPUs ({world}) must be divisible by --tp-size x --sp-size ({tp} x {sp})"
    if tp > 1 and sp > 1:
        # AutoTP builds a (dp, tp) mesh and Ulysses a (dp, sp) one over the whole world (deepspeed/utils/groups.py
        # and parallel_state_sp.py initialize_sequence_parallel): no 3D mesh composes them
        return f"--tp-size {tp} with --sp-size {sp}: DeepSpeed 0.19.8 does not compose AutoTP with Ulysses SP; use one"
    if tp > gpus_per_node:
        return f"--tp-size ({tp}) must not exceed the GPUs per node ({gpus_per_node}): AutoTP all-reduces every layer"
    if tp > 1 and (err := tp_heads_error(spec, tp)):
        return err
    if tp > 1 and zero_stage == 0:
        # without a ZeRO optimizer DeepSpeed clips with torch's norm over this rank's parameters only (no mpu under
        # AutoTP): measured on two CPU ranks, a norm of 1.28 where the whole model's is 1.60
        return (f"--tp-size {tp} with --zero 0: DeepSpeed's gradient norm (and clipping) without a ZeRO optimizer "
                "sees only this rank's AutoTP shards; use ZeRO 1-3")
    if sp > 1:
        if spec.is_moe:
            # an MoE gate's capacity and its balancing loss are sums over the tokens it sees: one shard's
            return f"--sp-size {sp} with {spec.arch}: an MoE gate's capacity and balancing loss would be per-shard"
        if spec.is_mod:
            # MoD routes the top-k tokens of the whole sequence; each SP rank sees 1/sp of it
            return f"--sp-size {sp} with {spec.arch}: MoD routes top-k over the whole sequence, which SP splits"
        if err := sp_heads_error(spec, sp):
            return err
        if seq_len % sp:
            return f"--seq-len ({seq_len}) must be divisible by --sp-size ({sp}) (ulysses_sp.py:707)"
    if spec.is_moe and ep_size and (world // layout.degree) % ep_size:
        where = "GPUs / (tp x pp)" if layout.pp > 1 else "GPUs / (tp x sp)"
        return (f"ep_size ({ep_size}) must divide the data-parallel size {world // layout.degree} "
                f"({where}): DeepSpeed MoE builds expert groups inside data-parallel groups")
    if layout.zeropp:
        knobs = ", ".join(k for k, on in (("--zero-hpz", hpz > 1), ("qwZ", layout.qwz), ("qgZ", layout.qgz)) if on)
        if spec.is_moe:
            return f"ZeRO++ ({knobs}) is ZeRO-3 only, and DeepSpeed's native MoE refuses ZeRO-3"
        if zero_stage is not None and zero_stage != 3:
            return f"ZeRO++ ({knobs}) works only with ZeRO-3 (stage3.py); --zero {zero_stage} would ignore it"
    if hpz > 1:
        if gpus_per_node % hpz:
            return f"--zero-hpz ({hpz}) must divide the GPUs per node ({gpus_per_node}): hpZ keeps its copy within a node"
        if tp > 1:
            # groups.py _create_zero_param_parallel_group: consecutive ranks, blind to the TP groups
            return f"--zero-hpz {hpz} with --tp-size {tp}: DeepSpeed builds hpZ groups from consecutive ranks, across TP shards"
    if layout.qgz and tp > 1:
        # coalesced_collectives.py all_to_all_quant_reduce: its 2-stage all-to-all spans the whole world
        return f"qgZ with --tp-size {tp}: DeepSpeed's quantized gradient all-to-all spans all GPUs, not the ZeRO group"
    return None


def pp_error(spec: ModelSpec, layout: Layout, *, world: int, zero_stage: int | None) -> str | None:
    """What DeepSpeed 0.19.8's pipeline engine refuses or cannot compose (docs/DESIGN.md gives the file:line)."""
    pp, tp, sp = layout.pp, layout.tp, layout.sp
    if zero_stage is not None and zero_stage >= 2:
        return (f"--zero {zero_stage} with --pp-size {pp}: DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3 "
                "(runtime/pipe/engine.py:76); use --zero 1")
    if world % (pp * tp * sp):
        return f"the number of GPUs ({world}) must be divisible by --pp-size x --tp-size ({pp} x {tp})"
    if pp > spec.num_hidden_layers:
        return f"--pp-size ({pp}) must not exceed the decoder layers ({spec.num_hidden_layers}): a stage per block at most"
    if sp > 1:
        # Ulysses builds its (dp, sp) mesh over the whole world (sequence_parallel/parallel_state_sp.py), blind to
        # the pipeline's stages
        return f"--sp-size {sp} with --pp-size {pp}: DeepSpeed 0.19.8 does not compose Ulysses SP with its pipeline engine"
    if layout.zeropp:
        return f"ZeRO++ with --pp-size {pp}: ZeRO++ is ZeRO-3 only, which the pipeline engine refuses"
    return None


def tp_sharded_params(spec: ModelSpec, total: int) -> int:
    """Parameters AutoTP shards in training: every nn.Linear (column- or row-parallel, lm_head column-parallel
    with gathered output) and nn.Embedding (hidden dim): module_inject/auto_tp.py linear_policies
    {nn.Linear: _replace, nn.Embedding: _slice_embedding}. RMSNorm weights stay replicated."""
    norms = (2 * spec.num_hidden_layers + 1) * spec.hidden_size
    return total - norms


def tp_activation_factor(tp: int) -> float:
    """Share of a layer's activations one TP rank holds (Korthikanti Table 2, no sequence parallel)."""
    return TP_REPLICATED_ACTIVATION_SHARE + (1 - TP_REPLICATED_ACTIVATION_SHARE) / tp


def tp_allreduce_bytes_per_layer(tokens: int, hidden: int, bytes_per_value: int) -> float:
    """Forward: two all-reduces per layer (attention out, MLP out), backward two more (their inputs'
    grads), each of tokens x hidden 16-bit values (module_inject/layers.py LinearAllreduce, LinearLayer)."""
    return 4 * tokens * hidden * bytes_per_value


def expert_tp_bytes_per_moe_layer(tokens: int, spec: ModelSpec, capacity_factor: float, tp: int,
                                  bytes_per_value: int) -> float:
    """Bytes one TP rank sends per MoE layer for expert tensor parallelism, beyond a dense layer's all-reduces
    (moe/sharded_moe.py MOELayer, moe/mappings.py): the dispatched slots (tokens x top-k x capacity factor)
    are all-gathered over the TP group before the experts, and again in backward (drop_tokens' gradient);
    the experts' row-parallel all-reduces (forward output, backward input gradient) run over the slots
    instead of the tokens."""
    hidden = spec.hidden_size * bytes_per_value
    slots = tokens * spec.num_experts_per_tok * capacity_factor
    gathers = 2 * slots * hidden * (tp - 1) / tp
    allreduces = 2 * (slots - tokens) * hidden * 2 * (tp - 1) / tp
    return gathers + max(0.0, allreduces)


def sp_alltoall_bytes_per_layer(spec: ModelSpec, local_tokens: int, sp: int, bytes_per_value: int) -> float:
    """Ulysses: forward all-to-alls of q, k, v into head shards and of the output back, the same in backward.
    Local tensors are (tokens/sp) x heads x head_dim; kv heads fewer than sp are replicated to sp."""
    hd = spec.head_dim
    q = spec.num_attention_heads * hd
    kv = max(spec.num_key_value_heads, sp) * hd
    return 2 * local_tokens * (q + 2 * kv + q) * bytes_per_value


__all__ = ["Layout", "pp_error", "QGZ_BYTES_PER_PARAM", "QWZ_BYTES_PER_PARAM", "divisors_up_to", "expert_tp_bytes_per_moe_layer",
           "layout_error",
           "sp_alltoall_bytes_per_layer", "sp_heads_error", "tp_activation_factor", "tp_allreduce_bytes_per_layer",
           "tp_sharded_params"]
