"""The planner: search DeepSpeed settings for a model on a GPU type and pick the fastest that fits.

Pure functions over frozen dataclasses. `fit(request) -> Plan`.
"""

from __future__ import annotations

import math
from dataclasses import field, replace
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING

from adaptive.errors import AdaptiveError, closest, require_positive
from adaptive.plan.estimate.activations import CHECKPOINTING, KERNELS, SELECTIVE_POLICIES, parse_checkpoint_policy
from adaptive.plan.search.advice import OrchestratorAdvice, orchestrator_advice
from adaptive.plan.search.finetune_rules import (finetune_error, finetune_rungs, offloads_for, stages_for,
                                                 transformers_moe)
from adaptive.plan.search.request import DeepSpeedBuckets, FitRequest
from adaptive.plan.search.stack_rules import stack_error, stages_and_offloads
from adaptive.plan.hardware.gpus import CATALOG, GPU, format_gib
from adaptive.plan.estimate.memory import MemoryEstimate, TrainSetup, corrected, estimate_memory
from adaptive.plan.estimate.parallel import Layout, divisors_up_to, layout_error
from adaptive.plan.architecture.params import ParamCounts, count_params
from adaptive.plan.architecture.presets import PRESETS, ModelSpec, spec_from_shape
from adaptive.plan.finetune import defaults as finetune_defaults
from adaptive.plan.finetune.method import Finetune
from adaptive.plan.finetune.roles import ParamRoles, param_roles
from adaptive.plan.quality.hyperparams import Hyperparams, compute_optimal
from adaptive.plan.quality.predict import Quality, predict
from adaptive.plan.search.tight import TIGHT_MARGIN, deciding_part, is_tight
from adaptive.plan.estimate.throughput import (Throughput, cost_usd, estimate_throughput, model_flops_per_token,
                                               train_hours)
from adaptive.record import record

if TYPE_CHECKING:  # a plain `adaptive fit` does not import them
    from adaptive.plan.estimate.calibration import Calibration
    from adaptive.plan.estimate.nvme import NvmeDrive

OFFLOADS = ("none", "optimizer", "all")
NVME_OFFLOADS = ("nvme", "nvme-optimizer")  # ZeRO-Infinity: optimizer states and parameters, or the states alone


def offload_flags(offload: str) -> tuple[bool, bool, str]:
    """(optimizer offloaded, parameters offloaded, device) of an --offload value."""
    return (offload != "none", offload in ("all", "nvme"), "nvme" if offload in NVME_OFFLOADS else "cpu")


def offload_name(setup: TrainSetup) -> str:
    """The --offload value of a setup: none | optimizer | all | nvme | nvme-optimizer."""
    if setup.offload_device == "nvme":
        return "nvme" if setup.offload_params else "nvme-optimizer"
    return "all" if setup.offload_params else "optimizer" if setup.offload_optimizer else "none"
CHINCHILLA_TOKENS_PER_PARAM = 20
MAX_MICRO_BATCH = 64
HOST_MEM_PER_GPU_MEM = 3


@record
class Candidate:
    """One configuration the search evaluated, and whether it fits."""

    setup: TrainSetup
    memory: MemoryEstimate
    fits_gpu: bool  # the peak leaves the request's headroom free
    fits_host: bool
    gpu: GPU  # the throughput is estimated for this GPU
    mfu: float | None = None  # --mfu: a given hardware utilisation instead of the per-op model
    compute_scale: float = 1.0  # --calibrate RUN_DIR: measured over modelled compute
    fits_capacity: bool = True  # the peak fits the GPU's whole memory (False with fits_gpu: the headroom decided)

    @property
    def grad_accum(self) -> int:
        return self.setup.gradient_accumulation_steps

    @cached_property
    def throughput(self) -> Throughput:
        """Estimated when first asked: most candidates a search evaluates do not fit, and only fitting ones
        (or, without a fit, those that fit the GPU) are ever ranked by speed."""
        return estimate_throughput(self.setup, self.gpu, self.grad_accum, self.mfu, self.compute_scale)

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host


@record
class LadderStep:
    """One rung of the OOM playbook: the change and its peak."""

    change: str
    peak_gpu_bytes: int
    fits: bool
    fits_gpu: bool  # False with fits_gpu True means the offload needs more host RAM


@record
class Plan:
    """What `fit` answers: the chosen (or closest) configuration and everything shown with it."""

    request: FitRequest
    counts: ParamCounts
    best: Candidate | None  # the chosen fitting plan, None when nothing fits
    closest: Candidate  # best when it fits, else the pinned/naive candidate with the smallest peak
    ladder: tuple[LadderStep, ...]
    train_tokens: float
    global_batch_tokens: int
    host_mem_bytes: int
    orchestrator: OrchestratorAdvice
    suggestions: tuple[str, ...] = field(default=())
    searched: int = 0
    quality: Quality | None = None  # the predicted final loss (quality.predict)
    hyperparams: Hyperparams | None = None  # DeepSeek LLM's compute-optimal batch and learning rate for this run
    roles: ParamRoles | None = None  # trainable and frozen parameters (a fine-tune's split; all trainable otherwise)
    quality_note: str | None = None  # why no loss is predicted (a fine-tune)
    headroom_bytes: int = 0  # GPU memory every candidate left free (request.headroom)
    ruled_out: tuple[Candidate, ...] = ()  # faster candidates that fit the whole GPU and host RAM, not the headroom
    released: tuple[tuple[str, ...], Candidate] | None = None  # (pinned flags, what fits without them) when pins forced it
    pinned: tuple[str, ...] = ()  # the pins as typed ("--zero 0"), said beside a refusal they did not decide alone

    @property
    def fits(self) -> bool:
        return self.best is not None

    @property
    def shown(self) -> Candidate:
        return self.best or self.closest

    @property
    def tight(self) -> bool:
        """Fits, but within TIGHT_MARGIN (the corpus's largest peak under-prediction) of capacity."""
        return self.fits and is_tight(self.shown.memory.peak_gpu_bytes, self.request.gpu.memory_bytes)

    @property
    def tight_margin(self) -> float:
        return TIGHT_MARGIN

    @property
    def tight_part(self) -> str | None:
        m = self.shown.memory
        return deciding_part(m.parts, m.peak_phase) if self.tight else None

    @property
    def hours(self) -> float:
        return train_hours(self.train_tokens, self.shown.throughput.tokens_per_second)

    @property
    def cost(self) -> float:
        return cost_usd(self.hours, self.request.world_size, self.request.gpu.price_per_hour)


def default_global_batch_tokens(active_params: int) -> int:
    """Global batch in tokens by model size: 0.5M tokens at ~1B, 1M at ~7B, 2M from ~14B
    (the claims we compared against use 512K for b1 and 1M for b7, docs/BENCHMARKS.md; Llama 2 used 4M
    at 70B)."""
    if active_params < 50e6:
        return 64 * 1024
    if active_params < 500e6:
        return 256 * 1024
    if active_params < 3e9:
        return 512 * 1024
    if active_params < 12e9:
        return 1024 * 1024
    return 2048 * 1024


def validate(req: FitRequest) -> None:
    for name, value in (("--gpus", req.gpus_per_node), ("--nodes", req.num_nodes), ("--seq-len", req.seq_len),
                        ("--min-seq-len", req.min_seq_len), ("--global-batch-tokens", req.global_batch_tokens),
                        ("--tokens", req.train_tokens), ("--micro-batch", req.micro_batch_size),
                        ("--grad-accum", req.grad_accum), ("--ep-size", req.ep_size),
                        ("--capacity-factor", req.capacity_factor), ("--mfu", req.mfu),
                        ("--host-mem", req.host_mem_bytes)):
        require_positive(name, value)
    if req.mfu is not None and req.mfu > 1:
        raise AdaptiveError(f"--mfu is a fraction of peak and must be at most 1, got {req.mfu}")
    if req.zero_stage is not None and req.zero_stage not in (0, 1, 2, 3):
        raise AdaptiveError(f"--zero must be 0, 1, 2 or 3, got {req.zero_stage}")
    if req.offload is not None and req.offload not in OFFLOADS + NVME_OFFLOADS:
        raise AdaptiveError(f"--offload must be one of {', '.join(OFFLOADS + NVME_OFFLOADS)}, got {req.offload!r}")
    if req.offload == "all" and req.zero_stage not in (None, 3):
        raise AdaptiveError(f"--offload all offloads parameters, which needs ZeRO-3, not --zero {req.zero_stage}")
    if req.offload not in (None, "none") and req.zero_stage == 0:
        raise AdaptiveError("--offload needs ZeRO stage 1 or higher; --zero 0 has no partitioned optimizer")
    if req.checkpointing is not None and req.checkpointing not in CHECKPOINTING:
        try:
            parse_checkpoint_policy(req.checkpointing)
        except ValueError:
            raise AdaptiveError(f"--checkpoint-policy must be off, selective, full or a policy (mlp, every:N), "
                                f"got {req.checkpointing!r}") from None
    if (req.checkpointing is not None and req.gradient_checkpointing is not None
            and (req.checkpointing == "full") != req.gradient_checkpointing):
        raise AdaptiveError(f"--checkpoint-policy {req.checkpointing} contradicts the pinned "
                            f"{'--checkpointing' if req.gradient_checkpointing else '--no-checkpointing'}")
    if req.kernels not in KERNELS:
        near = closest(req.kernels, KERNELS)
        raise AdaptiveError(f"--kernels must be one of {', '.join(KERNELS)}, got {req.kernels!r}"
                            + (f"; did you mean {near}?" if near else ""))
    if req.min_seq_len is not None and req.min_seq_len > req.seq_len:
        raise AdaptiveError(f"--min-seq-len ({req.min_seq_len}) must not exceed --seq-len ({req.seq_len})")
    if req.seq_len > req.spec.max_position_embeddings * 8:
        raise AdaptiveError(f"--seq-len {req.seq_len} is far beyond the model's "
                            f"max_position_embeddings ({req.spec.max_position_embeddings})")
    s = req.spec
    if err := finetune_error(req):
        raise AdaptiveError(err)
    if err := stack_error(req):
        raise AdaptiveError(err)
    if s.is_moe and not transformers_moe(req):
        if req.zero_stage == 3:
            raise AdaptiveError("--zero 3 is impossible for MoE: DeepSpeed's native MoE refuses ZeRO stage 3; use --zero 2")
        if req.ep_size is not None:
            if s.num_local_experts % req.ep_size:
                raise AdaptiveError(f"num_experts ({s.num_local_experts}) must be divisible by ep_size ({req.ep_size})")
            if req.world_size % req.ep_size:
                raise AdaptiveError(f"the number of GPUs ({req.world_size}) must be divisible by ep_size ({req.ep_size})")
    elif req.ep_size not in (None, 1):
        raise AdaptiveError(f"--ep-size {req.ep_size} needs an MoE model; {s.name} {s.arch} has no experts")
    for name, value in (("--sp-size", req.sp_size), ("--tp-size", req.tp_size), ("--zero-hpz", req.zero_hpz),
                        ("--pp-size", req.pp_size)):
        require_positive(name, value)
    pinned = Layout(tp=req.tp_size or 1, sp=req.sp_size or 1, hpz=req.zero_hpz or 1,
                    qwz=bool(req.zero_quantized_weights), qgz=bool(req.zero_quantized_gradients), pp=req.pp_size or 1)
    if err := layout_error(s, pinned, world=req.world_size, gpus_per_node=req.gpus_per_node, seq_len=req.seq_len,
                           zero_stage=req.zero_stage, ep_size=req.ep_size):
        raise AdaptiveError(err)


def check_batch_pins(req: FitRequest) -> None:
    """A --global-batch-tokens the user gave must be what the pinned micro-batch and accumulation make
    (at the requested sequence): one sequence per GPU at least, and split evenly."""
    seq = req.seq_len
    samples = max(1, round(req.global_batch_tokens / seq))
    layouts = layout_candidates(req, samples)
    if not layouts:
        largest = max_model_parallel(req)
        n = req.world_size // largest
        per = f"model replica ({req.world_size} GPUs / tp x sp {largest})" if largest > 1 else "GPU"
        raise AdaptiveError(f"--global-batch-tokens {req.global_batch_tokens} is less than one sequence of {seq} per "
                            f"{per}: {n} replicas need at least {n * seq}")
    n = req.world_size // layouts[0].degree
    micro, accum = req.micro_batch_size, req.grad_accum
    if micro and accum:
        if micro * accum * n != samples:
            raise AdaptiveError(
                f"--micro-batch {micro} x --grad-accum {accum} x {n} {'GPUs' if n == req.world_size else 'replicas'} "
                f"x --seq-len {seq} = "
                f"{micro * accum * n * seq} tokens, not --global-batch-tokens {req.global_batch_tokens}; "
                f"drop one of them or make them agree")
        return
    for flag, value in (("--micro-batch", micro), ("--grad-accum", accum)):
        if value and (samples % n or (samples // n) % value):
            per_gpu = samples / n
            where = "GPU" if n == req.world_size else "model replica"
            raise AdaptiveError(
                f"{flag} {value} cannot keep --global-batch-tokens {req.global_batch_tokens}: that is "
                f"{per_gpu:g} sequences of {seq} per {where} ({n} {where}s), which {value} does not divide")


def sequence_candidates(req: FitRequest) -> list[int]:
    """The requested length first, then 3/4, 1/2, ... (multiples of 64) down to --min-seq-len."""
    seqs = [req.seq_len]
    if req.min_seq_len is None:
        return seqs
    for frac in (0.75, 0.5, 0.375, 0.25, 0.125):
        s = max(64, int(req.seq_len * frac) // 64 * 64)
        if s >= req.min_seq_len and s not in seqs:
            seqs.append(s)
    if req.min_seq_len not in seqs:
        seqs.append(req.min_seq_len)
    return seqs


def ep_candidates(req: FitRequest) -> list[int]:
    s = req.spec
    if not s.is_moe or transformers_moe(req):
        return [1]
    if req.ep_size is not None:
        return [req.ep_size]
    return [e for e in range(1, s.num_local_experts + 1)
            if s.num_local_experts % e == 0 and req.world_size % e == 0]


def _layout_ok(req: FitRequest, layout: Layout) -> bool:
    return layout_error(req.spec, layout, world=req.world_size, gpus_per_node=req.gpus_per_node,
                        seq_len=req.seq_len, zero_stage=req.zero_stage, ep_size=req.ep_size) is None


def model_parallel_layouts(req: FitRequest) -> list[Layout]:
    """(tp, sp) layouts DeepSpeed can run here, fewest GPUs per replica first; pinned sizes are kept.
    TP stays inside a node; SP up to the attention heads' limit (parallel.py)."""
    tps = [req.tp_size] if req.tp_size else divisors_up_to(req.gpus_per_node, req.gpus_per_node)
    pp = req.pp_size or 1  # the pipeline's stages are searched one size at a time (search)
    sps = [req.sp_size] if req.sp_size else [1] if pp > 1 else divisors_up_to(req.world_size,
                                                                            req.spec.num_attention_heads)
    if req.adapted:  # LoRA and QLoRA: ZeRO data parallelism only (finetune_rules.py)
        tps, sps = [1], [1]
    out = [Layout(tp=t, sp=p, pp=pp) for t in tps for p in sps if _layout_ok(req, Layout(tp=t, sp=p, pp=pp))]
    return sorted(out, key=lambda lay: (lay.degree, lay.sp))  # TP first at a degree: intra-node by construction


def max_model_parallel(req: FitRequest) -> int:
    layouts = model_parallel_layouts(req)
    return max(lay.degree for lay in layouts) if layouts else 1


def layout_candidates(req: FitRequest, samples: int) -> list[Layout]:
    """Layouts whose replicas get at least one sequence of the global batch each."""
    return [lay for lay in model_parallel_layouts(req) if req.world_size // lay.degree <= samples]


def zeropp_variants(req: FitRequest, zero: int, layout: Layout) -> list[Layout]:
    """ZeRO++ settings to try with a layout: pinned ones as given; free ones, with ZeRO-3 across nodes, also
    hpZ over the node and int8 weights with int4 gradients (they only pay when gathers cross nodes)."""
    if zero != 3 or req.adapted:
        return [layout]
    across = req.num_nodes > 1
    hpzs = [req.zero_hpz] if req.zero_hpz is not None else [1, req.gpus_per_node] if across else [1]
    qw, qg = req.zero_quantized_weights, req.zero_quantized_gradients
    quants = ([(bool(qw), bool(qg))] if qw is not None or qg is not None
              else [(False, False), (True, True)] if across else [(False, False)])
    out = []
    for hpz in dict.fromkeys(hpzs):
        for w, g in quants:
            v = replace(layout, hpz=hpz, qwz=w, qgz=g)
            if v == layout or layout_error(req.spec, v, world=req.world_size, gpus_per_node=req.gpus_per_node,
                                           seq_len=req.seq_len, zero_stage=3, ep_size=req.ep_size) is None:
                out.append(v)
    return out  # empty: a pinned ZeRO++ setting this layout cannot run (hpZ or qgZ with AutoTP)


def zero_offload_candidates(req: FitRequest) -> list[tuple[int, str]]:
    if (req.pp_size or 1) > 1:  # DeepSpeed's pipeline engine: ZeRO-1 at most (pipe/engine.py:76); no offload searched
        return [(req.zero_stage if req.zero_stage is not None else 1, req.offload or "none")]
    stages = [req.zero_stage] if req.zero_stage is not None else [0, 1, 2, 3]
    if (req.zero_hpz or 1) > 1 or req.zero_quantized_weights or req.zero_quantized_gradients:
        stages = [3]  # ZeRO++ pinned: only ZeRO-3 runs it
    out = []
    for z in stages_for(req, stages):
        for off in offloads_for(req, z, OFFLOADS):
            if off in ("all", *NVME_OFFLOADS) and z != 3:
                continue
            if off != "none" and z == 0:
                continue
            if off == "none" and req.optimizer == "deepspeed_cpu_adam":
                continue  # DeepSpeedCPUAdam runs only on offloaded states
            out.append((z, off))
    return stages_and_offloads(req, out)


def grad_accum_for(req: FitRequest, global_tokens: int, seq: int, micro: int, replicas: int | None = None) -> int:
    samples = max(1, round(global_tokens / seq))
    per_rank = samples / (replicas or req.world_size)
    return max(1, math.ceil(per_rank / micro))


def micro_batch_candidates(req: FitRequest, global_tokens: int, seq: int, replicas: int | None = None) -> list[int]:
    if req.micro_batch_size is not None:
        return [req.micro_batch_size]
    per_rank = max(1, math.ceil(global_tokens / seq / (replicas or req.world_size)))
    if req.grad_accum is not None:
        return [max(1, math.ceil(per_rank / req.grad_accum))]
    out, m = [], 1
    while m <= min(per_rank, MAX_MICRO_BATCH):
        out.append(m)
        m *= 2
    return out


def evaluate(req: FitRequest, spec: ModelSpec, seq: int, micro: int, zero: int, offload: str,
             ckpt: bool | str, ep: int, global_tokens: int, host_mem: int, layout: Layout = Layout()) -> Candidate:
    """`ckpt`: False/True (off/full) or a checkpointing policy."""
    accum = req.grad_accum or grad_accum_for(req, global_tokens, seq, micro, req.world_size // layout.degree)
    if not req.grad_accum and req.global_batch_tokens is None and layout.sp > 1:
        # DeepSpeed's Ulysses data adapter gathers each SP rank's micro-batch and shards it over the group:
        # a group runs whole multiples of sp micro-batches per step (a batch by size may round up to that)
        accum = math.ceil(accum / layout.sp) * layout.sp
    policy = ("full" if ckpt else "off") if isinstance(ckpt, bool) else ckpt
    setup, memory = _setup_and_memory(spec, seq, micro, zero, offload, policy, ep, accum, layout, req.gpus_per_node,
                                      req.num_nodes, req.capacity_factor, req.calibration, req.optimizer,
                                      req.attention, not req.gpu.bf16, req.kernels, req.ds_config, req.stack, req.elementwise,
                                      req.finetune, req.nvme if offload in NVME_OFFLOADS else None,
                                      req.memory_knobs)
    mem = corrected(memory, req.peak_correction)
    return Candidate(setup=setup, memory=mem, fits_gpu=mem.peak_gpu_bytes <= req.usable_bytes,
                     fits_host=mem.host_bytes_per_node <= host_mem, gpu=req.gpu, mfu=req.mfu,
                     compute_scale=req.compute_scale, fits_capacity=mem.peak_gpu_bytes <= req.gpu.memory_bytes)


@lru_cache(maxsize=4096, typed=True)  # one large request (b70 MoE on 8 H100s, not fitting) holds ~3,600
def _setup_and_memory(spec: ModelSpec, seq: int, micro: int, zero: int, offload: str, policy: str, ep: int,
                      accum: int, layout: Layout, gpus_per_node: int, num_nodes: int, capacity_factor: float,
                      calibration: Calibration | None, optimizer: str, attention: str, fp16: bool, kernels: str,
                      ds: DeepSpeedBuckets | None, stack: str = "eager",
                      elementwise: str | None = None, finetune: Finetune | None = None,
                      nvme: NvmeDrive | None = None,
                      memory_knobs: tuple[tuple[str, object], ...] = ()) -> tuple[TrainSetup, MemoryEstimate]:
    """A candidate's setup and its memory, which does not depend on the GPU it is planned for (its precision is
    in the setup): "what would fit" searches GPU after GPU over the same setups, so each is built and estimated
    once (both are pure functions of these arguments)."""
    buckets = {} if ds is None else dict(
        reduce_bucket_elements=ds.reduce_bucket_elements, allgather_bucket_elements=ds.allgather_bucket_elements,
        prefetch_bucket_elements=ds.prefetch_bucket_elements, overlap_comm=ds.overlap_for(zero))
    offload_optimizer, offload_params, device = offload_flags(offload)
    setup = TrainSetup(spec=spec, seq_len=seq, micro_batch_size=micro, zero_stage=zero,
                       offload_optimizer=offload_optimizer, offload_params=offload_params, offload_device=device,
                       finetune=finetune, nvme=nvme,
                       gradient_checkpointing=policy == "full", gpus_per_node=gpus_per_node,
                       num_nodes=num_nodes, ep_size=ep, capacity_factor=capacity_factor,
                       calibration=calibration, gradient_accumulation_steps=accum, optimizer=optimizer,
                       attention=attention, fp16=fp16, kernels=kernels, stack=stack, elementwise=elementwise,
                       checkpoint_policy=None if policy in ("off", "full") else policy, tp_size=layout.tp,
                       sp_size=layout.sp, pp_size=layout.pp, zero_hpz=layout.hpz, zero_quantized_weights=layout.qwz,
                       zero_quantized_gradients=layout.qgz, **buckets, **dict(memory_knobs))
    return setup, estimate_memory(setup)


# Candidates within this much of the fastest are a tie, decided by `_preference`: a rounding-level gain in the
# predicted speed is not worth a more complex layout (ZeRO++'s quantized collectives and second parameter copy,
# a higher ZeRO stage's per-layer gathers, more parallel dimensions)
SPEED_TIE = 0.02


def _best_of(fitting: list[Candidate]) -> Candidate:
    fastest = max(c.throughput.tokens_per_second for c in fitting)
    return max((c for c in fitting if c.throughput.tokens_per_second * (1 + SPEED_TIE) >= fastest), key=_preference)


def _preference(c: Candidate) -> tuple:
    """Among candidates as fast as the fastest (SPEED_TIE), the simplest: no ZeRO++, fewer GPUs per model replica,
    no offload, lower ZeRO, fewer expert-parallel ranks; then bigger micro-batches, more memory headroom, speed."""
    s = c.setup
    zeropp = s.zero_hpz > 1 or s.zero_quantized_weights or s.zero_quantized_gradients
    return (not zeropp, -s.tp_size * s.sp_size, -s.pp_size, not s.offload_optimizer, -s.zero_stage, -s.ep_size,
            s.micro_batch_size, -c.memory.peak_gpu_bytes, c.throughput.tokens_per_second)


def pp_candidates(req: FitRequest) -> list[int]:
    """Pipeline sizes to try: each divisor of the GPUs from 2 up to the decoder layers (and 64); none for LoRA."""
    if req.adapted:
        return []
    return [p for p in divisors_up_to(req.world_size, min(req.spec.num_hidden_layers, 64)) if p > 1]


def search(req: FitRequest, spec: ModelSpec, global_tokens: int, host_mem: int,
           ckpts: list[str] | None = None) -> tuple[Candidate | None, list[Candidate]]:
    """The best fitting candidate and everything evaluated. A pinned --pp-size plans that pipeline; unpinned,
    pipelines are searched too where the world spans nodes (what crosses them is the question) or nothing
    else fits, and one is chosen only when it is faster than the best layout without one."""
    pins_refuse_pp = ((req.zero_stage or 0) >= 2 or (req.sp_size or 1) > 1 or (req.zero_hpz or 1) > 1
                      or req.zero_quantized_weights or req.zero_quantized_gradients)  # parallel.py pp_error
    if req.pp_size is not None or pins_refuse_pp:
        return _search_layouts(req if req.pp_size is not None else replace(req, pp_size=1), spec, global_tokens,
                               host_mem, ckpts)
    plain, evaluated = _search_layouts(replace(req, pp_size=1), spec, global_tokens, host_mem, ckpts)
    if req.num_nodes == 1 and plain is not None:
        return plain, evaluated
    best = plain
    for pp in pp_candidates(req):
        found, more = _search_layouts(replace(req, pp_size=pp), spec, global_tokens, host_mem, ckpts)
        evaluated += more
        if found is not None and (best is None or found.throughput.tokens_per_second
                                  > (1 + SPEED_TIE) * best.throughput.tokens_per_second):
            best = found
    return best, evaluated


def _search_layouts(req: FitRequest, spec: ModelSpec, global_tokens: int, host_mem: int,
                    ckpts: list[str] | None = None) -> tuple[Candidate | None, list[Candidate]]:
    """The best fitting candidate at the longest sequence that fits, and everything evaluated.

    At each sequence, model-parallel layouts are tried by degree (tp x sp GPUs per replica), fewest first:
    data parallel alone when it fits, so the search grows only where DP alone cannot run (SP and TP come
    before a shorter sequence, as the OOM ladder's SP rung does). Once a degree above 1 is needed, the
    larger ones inside a node are tried too, and one beyond the first fit across nodes."""
    ckpts = ckpts or checkpointing_candidates(req)
    evaluated: list[Candidate] = []
    fitting: list[Candidate] = []
    for seq in sequence_candidates(req):
        seq_req = req if seq == req.seq_len else replace(req, seq_len=seq)
        runnable = model_parallel_layouts(seq_req)
        if not runnable:
            continue  # a pinned --sp-size that this shorter sequence does not divide
        # a default batch smaller than one sequence per GPU grows to one per replica, as with DP alone
        layouts = layout_candidates(seq_req, max(1, round(global_tokens / seq))) or runnable[-1:]
        degrees = sorted({lay.degree for lay in layouts})
        for i, degree in enumerate(degrees):
            for layout in (lay for lay in layouts if lay.degree == degree):
                replicas = req.world_size // degree
                for zero, off in zero_offload_candidates(req):
                    if zero == 0 and layout.tp > 1:
                        continue  # parallel.py: ZeRO-0's gradient clipping is blind to AutoTP's shards
                    for variant in zeropp_variants(req, zero, layout):
                        for ep in ep_candidates(req):
                            if spec.is_moe and replicas % ep:
                                continue
                            for micro in micro_batch_candidates(req, global_tokens, seq, replicas):
                                # cheapest recompute first: at the same settings more recompute only costs
                                # time, so the first policy that fits is the only one worth keeping
                                for ckpt in ckpts:
                                    c = evaluate(req, spec, seq, micro, zero, off, ckpt, ep, global_tokens,
                                                 host_mem, variant)
                                    evaluated.append(c)
                                    if c.fits:
                                        fitting.append(c)
                                        break
                                else:
                                    if degree > 1:  # a larger micro-batch cannot fit where this one did not
                                        break
            # once model parallelism is needed, larger degrees may pay (less recompute, smaller gathers): every
            # degree inside a node (at most log2 of its GPUs), and beyond it one degree more than the first fit
            first = fitting[0].setup.tp_size * fitting[0].setup.sp_size if fitting else 0
            if (req.pp_size or 1) > 1:  # a pipeline tries every tensor-parallel size in the node (at most log2 of it)
                continue
            if fitting and (degree == 1 or i == len(degrees) - 1
                            or (degree >= req.gpus_per_node and first < degree)):
                return _best_of(fitting), evaluated
        if fitting:
            return _best_of(fitting), evaluated
    return None, evaluated


def selective_policies(req: FitRequest) -> tuple[str, ...]:
    """The selective policies the model class runs: transformers' classes checkpoint whole layers
    (`every_n_layers`), so "mlp" (half of each layer) is adaptive's classes' alone."""
    return tuple(p for p in SELECTIVE_POLICIES if p != "mlp" or req.kernels != "plain")


def checkpointing_candidates(req: FitRequest) -> list[str]:
    """Policies to try, cheapest recompute first: off, the selective ones, full (the OOM ladder's order)."""
    if req.checkpointing == "selective":
        return list(selective_policies(req))
    if req.checkpointing is not None:
        return [req.checkpointing]
    if req.gradient_checkpointing is not None:
        return ["full" if req.gradient_checkpointing else "off"]
    if req.calibration is not None:  # a calibration file measures off and full only
        return ["off", "full"]
    return ["off", *selective_policies(req), "full"]


def _closeness(c: Candidate) -> tuple:
    """Without a fit: prefer what fits the GPU and needs the least host RAM, else the smallest peak."""
    if c.fits_gpu:
        return (0, c.memory.host_bytes_per_node, -c.throughput.tokens_per_second)
    return (1, c.memory.peak_gpu_bytes, 0)


def ladder(req: FitRequest, chosen: Candidate, global_tokens: int, host_mem: int) -> tuple[LadderStep, ...]:
    """The OOM playbook with our numbers: the naive config, then each remedy added in order. A fine-tune's adds, after
    checkpointing: an 8-bit optimizer, LoRA, QLoRA, and a full fine-tune with NVMe offload instead."""
    s = chosen.setup
    zero = s.zero_stage
    off = offload_name(s)

    # the naive rung runs without SP (unless pinned): SP is a remedy of its own, before a shorter sequence
    base = Layout(tp=s.tp_size, sp=req.sp_size or 1, hpz=s.zero_hpz, qwz=s.zero_quantized_weights,
                  qgz=s.zero_quantized_gradients, pp=s.pp_size)

    def step(change: str, spec: ModelSpec, seq: int, ckpt: bool | str, layout: Layout = base, r: FitRequest = req,
             z: int = zero, o: str = off) -> LadderStep:
        c = evaluate(r, spec, seq, 1, z, o, ckpt, s.ep_size if spec.is_moe else 1, global_tokens, host_mem, layout)
        return LadderStep(change, c.memory.peak_gpu_bytes, c.fits, c.fits_gpu)

    spec = req.spec
    mp = (f", tp {base.tp}" if base.tp > 1 else "") + (f", sp {base.sp}" if base.sp > 1 else "")
    mp += f", pp {base.pp}" if base.pp > 1 else ""
    steps = [step(f"naive: micro-batch 1, seq {req.seq_len}, no checkpointing, ZeRO-{zero}"
                  + (f" + offload {off}" if off != "none" else "") + mp, spec, req.seq_len, False)]
    selective = () if req.calibration is not None else selective_policies(req)  # calibrated: off and full only
    remedies = [(f"+ selective checkpointing ({policy})", spec, req.seq_len, policy) for policy in selective]
    remedies.append(("+ gradient checkpointing", spec, req.seq_len, True))
    if spec.is_moe and spec.name in PRESETS:
        spec = spec_from_shape(PRESETS[spec.name], "mod")
        remedies.append(("+ MoD instead of MoE", spec, req.seq_len, True))
    rungs = [(*r, base, req, zero, off) for r in remedies]
    last = (req, zero, off)
    for change, variant, z, o in finetune_rungs(req, zero, off):
        rungs.append((change, spec, req.seq_len, True, base, variant, z, o))
        if not change.startswith("instead"):
            last = (variant, z, o)
    if rung := sp_rung(last[0], spec, base, lambda lay: step("", spec, req.seq_len, True, lay, *last)):
        rungs.append((f"+ sequence parallel, sp {rung.sp} (the whole sequence kept)", spec, req.seq_len, True,
                      rung, *last))
    for frac in (0.75, 0.5):  # remedies add up: a shorter sequence keeps the SP rung's split
        seq = max(64, int(req.seq_len * frac) // 64 * 64)
        if seq < req.seq_len:
            layout = rung if rung and seq % rung.sp == 0 else base
            rungs.append((f"+ sequence {seq}", spec, seq, True, layout, *last))
    for change, spec, seq, ckpt, layout, r, z, o in rungs:
        s_ = step(change, spec, seq, ckpt, layout, r, z, o)
        # a remedy that no longer lowers the peak (model states dominate) is left out
        if s_.peak_gpu_bytes < steps[-1].peak_gpu_bytes:
            steps.append(s_)
    return tuple(steps)


def sp_rung(req: FitRequest, spec: ModelSpec, base: Layout, peak_at) -> Layout | None:
    """The OOM ladder's sequence-parallel rung, before a shorter sequence: the smallest SP size that fits at
    micro-batch 1 with checkpointing (else the largest DeepSpeed allows here); None where SP cannot apply
    (pinned, with AutoTP, MoD, or heads that no size above 1 divides)."""
    if req.sp_size is not None or base.tp > 1 or base.pp > 1 or spec.is_mod:
        return None
    sizes = [p for p in divisors_up_to(req.world_size, spec.num_attention_heads) if p > base.sp
             and layout_error(spec, replace(base, sp=p), world=req.world_size, gpus_per_node=req.gpus_per_node,
                              seq_len=req.seq_len, zero_stage=req.zero_stage, ep_size=req.ep_size) is None]
    for p in sizes:
        if peak_at(replace(base, sp=p)).fits:
            return replace(base, sp=p)
    return replace(base, sp=sizes[-1]) if sizes else None


FINETUNE_QUALITY_NOTE = ("no loss is predicted for a fine-tune: the scaling laws here describe pretraining from "
                         "scratch, and a fine-tune's loss depends on its checkpoint and its data")


def fit(req: FitRequest, suggest: bool = True) -> Plan:
    """Plan a run. Raises AdaptiveError for impossible requests; a plan that does not fit is a
    result (fits=False with suggestions, unless `suggest` is off), not an error."""
    validate(req)
    counts = count_params(req.spec)
    ft = req.finetune
    global_tokens = req.global_batch_tokens or (finetune_defaults.global_batch_tokens(ft, req.seq_len) if ft
                                                else default_global_batch_tokens(counts.active))
    if global_tokens < req.seq_len:
        raise AdaptiveError(f"--global-batch-tokens ({global_tokens}) must be at least one sequence ({req.seq_len})")
    if req.global_batch_tokens is not None:
        check_batch_pins(req)
    host_mem = host_mem_for(req)
    train_tokens = req.train_tokens or (finetune_tokens(req) if ft else CHINCHILLA_TOKENS_PER_PARAM * counts.active)
    best, evaluated = search(req, req.spec, global_tokens, host_mem)
    if not evaluated:
        raise AdaptiveError(f"nothing DeepSpeed can run takes these pins: {req.global_batch_tokens or global_tokens} "
                            "tokens need tensor parallelism here, which the pinned hpZ or qgZ do not compose with")
    closest = best or min(evaluated, key=_closeness)
    hours = train_hours(train_tokens, closest.throughput.tokens_per_second)
    advice = orchestrator_advice(req.spec, counts, req.world_size, hours)
    suggestions = what_would_fit(req, global_tokens, evaluated) if suggest and not best else ()
    if ft:
        quality, hyper, note = None, finetune_hyperparams(ft, global_tokens), FINETUNE_QUALITY_NOTE
    else:
        quality = predict(req.spec, counts, train_tokens, req.loss_model, req.unique_tokens, req.seq_len)
        hyper, note = hyperparams_for(req.spec, train_tokens, req.seq_len), None
    return Plan(request=req, counts=counts, best=best, closest=closest,
                ladder=ladder(req, closest, global_tokens, host_mem), train_tokens=train_tokens,
                global_batch_tokens=global_tokens, host_mem_bytes=host_mem, orchestrator=advice,
                suggestions=suggestions, searched=len(evaluated), quality=quality, hyperparams=hyper,
                roles=param_roles(req.spec, ft), quality_note=note,
                headroom_bytes=req.gpu.memory_bytes - req.usable_bytes, ruled_out=ruled_out_by_headroom(best, evaluated),
                released=released_pins(req, global_tokens, host_mem) if suggest and not best else None,
                pinned=tuple(_pin_words(req, fields, flag) for fields, flag in pins_of(req)) if suggest else ())


# the knobs a request can pin, as (FitRequest fields, flag): released together where they are one choice
PINS = ((("zero_stage",), "--zero"), (("offload",), "--offload"), (("micro_batch_size",), "--micro-batch"),
        (("grad_accum",), "--grad-accum"), (("gradient_checkpointing", "checkpointing"), "--checkpointing"),
        (("ep_size",), "--ep-size"), (("tp_size",), "--tp-size"), (("sp_size",), "--sp-size"),
        (("pp_size",), "--pp-size"), (("zero_hpz",), "--zero-hpz"),
        (("zero_quantized_weights", "zero_quantized_gradients"), "--zero-quantize"))
RULED_OUT_SHOWN = 3


def ruled_out_by_headroom(best: Candidate | None, evaluated: list[Candidate]) -> tuple[Candidate, ...]:
    """The fastest candidates (at most RULED_OUT_SHOWN) that fit the whole GPU and the host RAM but not the headroom,
    and that would have been chosen without it: faster than the chosen one beyond a tie (SPEED_TIE), or any when
    nothing fits. What keeping the headroom free cost."""
    out = [c for c in evaluated if c.fits_capacity and c.fits_host and not c.fits_gpu]
    if best is not None:
        out = [c for c in out if c.throughput.tokens_per_second > (1 + SPEED_TIE) * best.throughput.tokens_per_second]
    out.sort(key=lambda c: -c.throughput.tokens_per_second)
    return tuple(out[:RULED_OUT_SHOWN])


def released_pins(req: FitRequest, global_tokens: int, host_mem: int) -> tuple[tuple[str, ...], Candidate] | None:
    """When nothing fits: the pinned flag whose release alone lets a configuration fit on these GPUs (the first, in
    PINS' order), else all of them together if that does; None where the pins are not what rules a fit out."""
    pinned = pins_of(req)
    if not pinned:
        return None
    words = {flag: _pin_words(req, fields, flag) for fields, flag in pinned}
    tries = [[p] for p in pinned] + ([pinned] if len(pinned) > 1 else [])
    for group in tries:
        trial = replace(req, **{f: None for fields, _ in group for f in fields})
        found = search(trial, trial.spec, global_tokens, host_mem)[0]
        if found is not None:
            return tuple(words[flag] for _, flag in group), found
    return None


def pins_of(req: FitRequest) -> list[tuple[tuple[str, ...], str]]:
    """The PINS the request pins."""
    return [(fields, flag) for fields, flag in PINS if any(getattr(req, f) is not None for f in fields)]


def _pin_words(req: FitRequest, fields: tuple[str, ...], flag: str) -> str:
    """ "--zero 0", "--no-checkpointing", "--zero-quantize both": the pin as the user typed it."""
    value = getattr(req, fields[0])
    if fields[0] == "gradient_checkpointing":
        if req.checkpointing is not None:
            return f"--checkpoint-policy {req.checkpointing}"
        return "--checkpointing" if value else "--no-checkpointing"
    if fields[0] == "zero_quantized_weights":
        w, g = bool(value), bool(req.zero_quantized_gradients)
        return f"{flag} {'both' if w and g else 'weights' if w else 'gradients' if g else 'none'}"
    return f"{flag} {value}"


def finetune_tokens(req: FitRequest) -> float:
    """A fine-tune's training tokens: its dataset's tokens (--dataset-tokens) times --epochs."""
    dataset = req.unique_tokens or finetune_defaults.DEFAULT_DATASET_TOKENS
    return dataset * (req.epochs or finetune_defaults.DEFAULT_EPOCHS)


def finetune_hyperparams(ft: Finetune, global_tokens: int) -> Hyperparams:
    """The published recipe's batch and learning rate (finetune/defaults.py), where a pretraining plan offers DeepSeek
    LLM's compute-optimal ones."""
    r = finetune_defaults.recipe(ft)
    return Hyperparams(global_batch_tokens=global_tokens, lr=r.lr, flops=0.0, extrapolated=False, source=r.source)


def hyperparams_for(spec: ModelSpec, train_tokens: float, seq_len: int) -> Hyperparams:
    """DeepSeek LLM's B_opt and eta_opt at C = M D, M the FLOPs per token without the vocabulary projection."""
    flops = model_flops_per_token(spec, seq_len) - 6.0 * spec.vocab_size * spec.hidden_size
    return compute_optimal(flops, train_tokens)


def what_would_fit(req: FitRequest, global_tokens: int,
                   evaluated: list[Candidate] | None = None) -> tuple[str, ...]:
    """When nothing fits: a fine-tune's next rungs (8-bit optimizer, LoRA, QLoRA, NVMe offload), more GPUs of this
    type, a larger GPU, MoD instead of MoE, a shorter sequence. `evaluated`: the request's own search, when the caller
    has it (saves running it again)."""
    out = []
    gpu_only = [c for c in (evaluated if evaluated is not None else search_all(req, global_tokens)) if c.fits_gpu]
    free = replace(req, zero_stage=None, offload=None, micro_batch_size=None, grad_accum=None,
                   gradient_checkpointing=None, checkpointing=None, ep_size=None, min_seq_len=None,
                   tp_size=None, pp_size=1, zero_hpz=None, zero_quantized_weights=None, zero_quantized_gradients=None,
                   sp_size=req.sp_size or 1)  # hints search TP, not SP: the ladder shows the SP rung
    out += finetune_alternatives(req, free, global_tokens)
    for n in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        if n <= req.world_size:
            continue
        per_node = min(n, 8)
        trial = replace(free, gpus_per_node=per_node, num_nodes=n // per_node)
        if best := _best(trial, global_tokens):
            nodes = f" ({n // per_node} nodes of {per_node})" if n > 8 else ""
            out.append(f"{n} x {req.gpu.name}{nodes}: {describe(best)}")
            break
    # the next size up that fits, and the larger GPU that trains the budget cheapest (price per token)
    larger = [(g, best) for g in CATALOG.values() if g.memory_bytes > req.gpu.memory_bytes
              and (best := _best(replace(free, gpu=g), global_tokens))]
    if larger:
        def per_1b_tokens(gb: tuple[GPU, Candidate]) -> float:
            hours = train_hours(1e9, gb[1].throughput.tokens_per_second)
            return cost_usd(hours, req.world_size, gb[0].price_per_hour)

        smallest = min(larger, key=lambda gb: (gb[0].memory_bytes, gb[0].price_per_hour))
        cheapest = min(larger, key=per_1b_tokens)
        shown = [("a larger GPU", smallest)]
        if cheapest[0] is not smallest[0]:
            shown.append(("the cheapest larger GPU per token", cheapest))
        for why, gb in shown:
            out.append(f"{why}, {req.world_size} x {gb[0].name}: {describe(gb[1])}, "
                       f"${per_1b_tokens(gb):,.0f} per 1B tokens")
    spec = req.spec
    if spec.is_moe and spec.name in PRESETS:
        if best := _best(replace(free, spec=spec_from_shape(PRESETS[spec.name], "mod")), global_tokens):
            out.append(f"MoD instead of MoE (--arch mod): {describe(best)}")
    # a shorter sequence shrinks GPU activations only: no help where the GPU side already fits (host-bound)
    for seq in () if gpu_only else (req.seq_len * 3 // 4, req.seq_len // 2, req.seq_len // 4, 512, 256):
        if 64 <= seq < req.seq_len and (best := _best(replace(free, seq_len=seq), global_tokens)):
            out.append(f"a shorter sequence, --seq-len {seq}: {describe(best)}")
            break
    if gpu_only:
        need = min(c.memory.host_bytes_per_node for c in gpu_only)
        out.append(f"CPU offload on a host with {math.ceil(need / 2**30)} GiB of RAM per node (--host-mem)")
    if not out:
        out.append("nothing close fits: a smaller model preset")
    return tuple(out)


def finetune_alternatives(req: FitRequest, free: FitRequest, global_tokens: int) -> list[str]:
    """A fine-tune's rungs (finetune_rules.finetune_rungs), each planned on its own on these GPUs at its method's
    default batch: every one that fits, with its peak, speed and cost for the run's tokens."""
    out = []
    tokens = req.train_tokens or finetune_tokens(req)
    for change, variant, _, offload in finetune_rungs(req, 0, "none"):
        nvme = offload == "nvme"
        trial = replace(variant, zero_stage=3 if nvme else None, offload="nvme" if nvme else None,
                        micro_batch_size=None, grad_accum=None, gradient_checkpointing=None, checkpointing=None,
                        min_seq_len=None)
        batch = req.global_batch_tokens or finetune_defaults.global_batch_tokens(variant.finetune, req.seq_len)
        # every checkpointing policy, as `fit --finetune <rung>` searches: the rung offered is the plan it gives
        if not (best := search(trial, trial.spec, max(batch, trial.seq_len), host_mem_for(trial))[0]):
            continue
        hours = train_hours(tokens, best.throughput.tokens_per_second)
        what = change.removeprefix("+ ").removeprefix("instead: ")
        out.append(f"{what}: {describe(best)}, {best.throughput.tokens_per_second:,.0f} tokens/s, "
                   f"${cost_usd(hours, req.world_size, req.gpu.price_per_hour):,.2f} for {tokens / 1e6:,.0f}M tokens")
    return out


def search_all(req: FitRequest, global_tokens: int) -> list[Candidate]:
    return search(req, req.spec, global_tokens, host_mem_for(req))[1]


def _best(req: FitRequest, global_tokens: int) -> Candidate | None:
    """What-would-fit hints search checkpointing off and full only: the selective policies lie between
    them and would multiply the scan over the catalog by 2.5 (`adaptive fit` must stay well under a second)."""
    return search(req, req.spec, max(global_tokens, req.seq_len), host_mem_for(req), ["off", "full"])[0]


def describe(c: Candidate) -> str:
    """A one-line summary of a candidate: "ZeRO-2 + offload optimizer, micro-batch 2 x 64, ..." """
    s = c.setup
    name = offload_name(s)
    off = "" if name == "none" else f" + offload {name}"
    ckpt = {"off": "", "full": ", checkpointing"}.get(s.checkpointing, f", selective checkpointing {s.checkpointing}")
    ep = f", ep_size {s.ep_size}" if s.spec.is_moe else ""
    mp = (f", tp {s.tp_size}" if s.tp_size > 1 else "") + (f", sp {s.sp_size}" if s.sp_size > 1 else "")
    mp += f", pp {s.pp_size}" if s.pp_size > 1 else ""
    pp = ", ".join(k for k, on in ((f"hpZ {s.zero_hpz}", s.zero_hpz > 1), ("qwZ", s.zero_quantized_weights),
                                   ("qgZ", s.zero_quantized_gradients)) if on)
    mp += f", ZeRO++ {pp}" if pp else ""
    return (f"ZeRO-{s.zero_stage}{off}, micro-batch {s.micro_batch_size} x {c.grad_accum} accumulation{ckpt}{ep}{mp}, "
            f"peak {format_gib(c.memory.peak_gpu_bytes)}")


def host_mem_for(req: FitRequest) -> int:
    """Host RAM per node: --host-mem, else an assumed 3x the node's GPU memory (DGX A100: 1 TiB for
    320 GiB of GPU memory; DGX H100: 2 TiB for 640 GiB)."""
    return req.host_mem_bytes or HOST_MEM_PER_GPU_MEM * req.gpu.memory_bytes * req.gpus_per_node
