"""Per-GPU memory of one DeepSpeed training step, in bytes, part by part.

Model states follow DeepSpeed's own accounting (its `estimate_zero{2,3}_model_states_mem_needs`,
checked in tests/plan/estimate/test_memory_vs_deepspeed.py). Activations are counted tensor by tensor for
our blocks (see activations.py). Everything else is a stated allowance.

A fine-tune splits the parameters by role (finetune/roles.py): what trains gets a 16-bit weight, gradients and
optimizer states, partitioned as DeepSpeed partitions what requires a gradient (stage_1_and_2.py and stage3.py
build their groups from `requires_grad` parameters); what is frozen is only held, 16-bit or NF4, and only ZeRO-3
partitions it (it partitions every parameter). Pretraining and full fine-tuning train everything: the same
arithmetic with nothing frozen.

The stack a run trains on is five knobs of TrainSetup, each set where a published stack differs from DeepSpeed with
transformers' classes (docs/BENCHMARKS.md, "Fine-tunes against published runs"); at their defaults they change
nothing: `framework` (FRAMEWORKS: who partitions the states, `zero_stage` says how far), `precision` (PRECISIONS: fp32
master weights and moments, or everything in 16 bits), `loss` (activations.LOSSES), `optimizer_in_backward` and
`activation_offload`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache
from typing import TYPE_CHECKING

from adaptive.errors import AdaptiveError
from adaptive.plan.estimate.activations import (
    activation_bytes,
    backward_peak_bytes,
    counts_ops,
    eager_backward_extra_bytes,
    eager_extra_bytes,
    head_bytes,
    head_saved_bytes,
    loss_saved_bytes_per_token,
    loss_working_bytes,
)
from adaptive.plan.estimate.attention import eager_extra_saved_bytes, eager_recompute_bytes
from adaptive.plan.estimate.pipeline import in_flight
from adaptive.plan.estimate.pipeline import partition as partition_stages
from adaptive.plan.estimate.nvme import DEFAULT_DRIVE, NvmeDrive, NvmeEstimate, NvmeSetup, estimate_nvme, zero_tensors
from adaptive.plan.estimate.optimizers import (MASTER_BYTES, TRANSIENT_COPIES, is_paged, state_bytes_per_param,
                                               step_transient_bytes)
from adaptive.plan.estimate.parallel import tp_activation_factor, tp_sharded_params
from adaptive.plan.architecture.params import ParamCounts, count_params
from adaptive.plan.architecture.presets import ModelSpec
from adaptive.plan.finetune.method import Finetune
from adaptive.plan.finetune.roles import ParamRoles, dequantized_bytes, param_roles, trains_everything
from adaptive.record import record

if TYPE_CHECKING:  # `adaptive fit` without --calibrate does not import it
    from adaptive.plan.estimate.calibration import Calibration

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

# Who holds and partitions the training states. `zero_stage` is how far they are partitioned in every framework:
# 0 none, 1 optimizer states, 2 + gradients, 3 + parameters.
FRAMEWORKS: dict[str, str] = {
    "deepspeed": "DeepSpeed's ZeRO engine (what adaptive runs): its buckets, fp32 gradient partitions and flatten "
                 "copies (runtime/zero/stage_1_and_2.py, stage3.py), modules' parameters gathered one at a time",
    "torch": "PyTorch without DeepSpeed, on one GPU or under DistributedDataParallel (zero_stage 0): gradients in "
             "each parameter's .grad, freed by zero_grad(set_to_none=True); DDP copies every gradient into its "
             "buckets (torch/nn/parallel/distributed.py, gradient_as_bucket_view=False by default)",
    "fsdp": "PyTorch FSDP, FSDP1's FullyShardedDataParallel or FSDP2's fully_shard (zero_stage 3 = FULL_SHARD, "
            "2 = SHARD_GRAD_OP, 0 = NO_SHARD), a unit per decoder layer: a unit is unsharded whole, the one running "
            "and the one prefetched, its gradient unsharded for its reduce-scatter; the root unit (embedding, final "
            "norm, head) is not resharded after forward (FSDP1 _runtime_utils.py _post_forward_reshard, FSDP2 "
            "_fsdp_state.py _lazy_init: not for the root), so it stays whole until the backward ends",
    "fsdp_sharded_root": "FSDP as above with the embedding and the output in units of their own (torchtune's "
                         "custom_sharded_layers: ['tok_embeddings', 'output']), resharded after forward like the "
                         "layers: the root keeps only the final norm",
}
# What a parameter that trains costs beside its 16-bit weight.
PRECISIONS: dict[str, str] = {
    "mixed": "16-bit weights and gradients with an fp32 master copy and fp32 optimizer moments (DeepSpeed's bf16 "
             "and fp16 optimizers)",
    "pure": "everything in 16 bits, nothing in fp32: the model cast to bf16 and a torch optimizer over it, whose "
            "moments take the parameter's dtype (torch/optim/adamw.py _init_group: torch.zeros_like(p)); "
            "torchtune's `dtype: bf16`, lit-gpt's `--precision bf16-true`, fsdp_qlora's `--precision bf16`",
}


@record
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
    calibration: Calibration | None = None  # measured activations replace the formula
    gradient_accumulation_steps: int = 1  # ZeRO-0/1 hold every 16-bit gradient between boundaries
    optimizer: str = "auto"  # optimizers.py: its step's transient (foreach AdamW keeps an fp32 temporary)
    attention: str = "sdpa"  # attention.py: eager keeps the score-sized tensors
    # DeepSpeed buckets in elements; None: what our emitter writes (REDUCE_BUCKET_ELEMENTS etc., capped
    # by the model size). A user's ds_config (--ds-config) sets them, uncapped, as DeepSpeed allocates.
    reduce_bucket_elements: int | None = None
    allgather_bucket_elements: int | None = None
    prefetch_bucket_elements: int | None = None
    overlap_comm: bool = True  # ZeRO-1/2 double-buffer the reduce bucket with overlap_comm
    fp16: bool = False  # fp16 with loss scaling (no bf16 on the GPU): DeepSpeed's FP16_Optimizer at ZeRO-0
    kernels: str = "lean"  # adaptive's lean blocks, or "plain" (transformers' Llama ops): activations.py
    stack: str = "eager"  # time only (op_times.STACKS): the software stack that runs the kernels
    elementwise: str | None = None  # time only: a published run's own elementwise ops (op_times.FWD), else the stack's
    checkpoint_policy: str | None = None  # selective checkpointing ("mlp", "every:N") when not full
    # beyond data parallelism (parallel.py): GPUs per model replica are tp x sp; ZeRO++ on ZeRO-3
    tp_size: int = 1  # AutoTP
    sp_size: int = 1  # Ulysses sequence parallel
    pp_size: int = 1  # pipeline stages (DeepSpeed's pipeline engine, pipeline.py); micro-batches per step = accumulation
    zero_hpz: int = 1  # zero_hpz_partition_size (1: off)
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    finetune: Finetune | None = None  # None: pretraining; lora/qlora train adapters on a frozen base (roles.py)
    offload_device: str = "cpu"  # where offloaded states go: "cpu", or "nvme" (ZeRO-Infinity, ZeRO-3 only)
    nvme: NvmeDrive | None = None  # the drive, for offload_device "nvme" (nvme.py)
    # The training stack (module docstring); the defaults are adaptive's own and change nothing.
    framework: str = "deepspeed"  # FRAMEWORKS
    precision: str = "mixed"  # PRECISIONS
    loss: str | None = None  # activations.LOSSES: the loss's implementation (None: what `kernels` runs)
    # torchtune's optimizer_in_bwd (training/_memory.py register_optim_in_bwd_hooks): each parameter is stepped in
    # its post-accumulate-grad hook and its gradient freed there, so no full set of gradients ever exists
    optimizer_in_backward: bool = False
    # torchtune's enable_activation_offloading (training/_activation_offloading.py OffloadActivations): the layers'
    # saved tensors go to host memory in the forward and come back one layer at a time in the backward; the output
    # projection's and the loss's stay (NoOpManager around the output)
    activation_offload: bool = False

    @property
    def checkpointing(self) -> str:
        """The policy in force: "full", a selective one, or "off"."""
        if self.gradient_checkpointing:
            return "full"
        return self.checkpoint_policy or "off"

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.num_nodes

    @property
    def dp_size(self) -> int:
        """Model replicas: each takes its own sequences; an SP group shares one sequence, a TP group one batch, a
        pipeline's stages one model."""
        return self.world_size // (self.tp_size * self.sp_size * self.pp_size)

    @property
    def zero_group_size(self) -> int:
        """GPUs ZeRO partitions over: data and sequence parallel ranks hold the same parameters
        (engine.py: dp_process_group=self.seq_data_parallel_group), TP ranks different shards, pipeline stages
        different layers (a stage's ZeRO-1 partitions over its own data-parallel group)."""
        return self.world_size // (self.tp_size * self.pp_size)

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens of one micro-batch of one model replica (its sp x tp GPUs share them)."""
        return self.seq_len * self.micro_batch_size


@record
class MemoryEstimate:
    """Every part at its full size, and the peak, which counts only parts that coexist.

    A step has two moments that can peak: the start of backward (persistent states + activations,
    logits and the backward working set) and the optimizer step (persistent states + the gradients
    DeepSpeed materialises for it). Measured on DeepSpeed's own ZeRO code (tests/plan), the two
    never overlap, so peak = persistent + max(backward, optimizer step) + allowances.
    """

    parts: dict[str, int]  # part -> bytes per GPU, each at its full size
    persistent_bytes: int  # held for the whole step
    backward_bytes: int  # on top of persistent at the start of backward
    step_bytes: int  # on top of persistent during the optimizer step
    peak_gpu_bytes: int  # persistent + max(backward, step) + fragmentation + CUDA context
    host_bytes_per_node: int  # CPU RAM the offloaded states need on each node (0 without offload)
    saved_bytes: int = 0  # what autograd holds at the end of forward (plain: the log-softmax included)
    nvme_bytes_per_node: int = 0  # ZeRO-Infinity's swap files on each node's drive (nvme.py)

    @property
    def peak_phase(self) -> str:
        return "backward" if self.backward_bytes >= self.step_bytes else "optimizer_step"

    @property
    def allocated_peak_bytes(self) -> int:
        """The peak without the allowances: what `torch.cuda.max_memory_allocated` would show."""
        return self.persistent_bytes + max(self.backward_bytes, self.step_bytes)

    @property
    def model_state_bytes(self) -> int:
        """params + grads + optimizer (+ ZeRO-3 gathered layer, + a fine-tune's frozen base): DeepSpeed's estimator's
        quantity."""
        return sum(self.parts.get(k, 0) for k in ("params", "grads", "optimizer", "zero3_live_params",
                                                  "hpz_secondary_params", "frozen_params"))


def _sizes(setup: TrainSetup, c: ParamCounts) -> tuple[float, float]:
    """(16-bit params held per GPU, params in this GPU's ZeRO partition).

    Expert parameters live on ep_size-way shards: each GPU holds E/ep experts, and their ZeRO
    partition runs over the expert-data-parallel group of world/ep GPUs, so every parameter's
    optimizer state ends up split n ways.
    """
    dense = c.total - c.expert
    local = dense + c.expert / setup.ep_size
    world = setup.world_size // setup.pp_size  # a pipeline stage's GPUs hold its layers (c: the stage's counts)
    partition = c.total / world
    if setup.tp_size > 1:
        # AutoTP shards every linear and embedding (experts' linears too); the norms stay whole on each TP
        # rank. ZeRO then partitions each rank's share over world/tp GPUs: P/world, plus the norm copies.
        replicated = c.total - tp_sharded_params(setup.spec, c.total)
        local = (local - replicated) / setup.tp_size + replicated
        partition = (c.total + replicated * (setup.tp_size - 1)) / world
    return local, partition


def trained_counts(setup: TrainSetup, counts: ParamCounts) -> ParamCounts:
    """`counts` narrowed to what trains: all of it, or a fine-tune's adapters (the parameters with gradients and
    optimizer states, which DeepSpeed partitions under ZeRO-1/2)."""
    if trains_everything(setup.finetune):
        return counts
    roles = param_roles(setup.spec, setup.finetune)
    return replace(counts, total=roles.trainable, expert=roles.trainable_expert)


def frozen_bytes_per_gpu(setup: TrainSetup, roles: ParamRoles) -> int:
    """The frozen base one GPU holds: whole under ZeRO-0/1/2, its parameters partitioned under ZeRO-3 (the NF4
    codes too, stored as 16-bit values for it: PEFT's DeepSpeed guide, bnb_4bit_quant_storage) while their
    quantization state stays whole; with parameter offload the 16-bit base lives on the host."""
    if not roles.frozen:
        return 0
    if setup.zero_stage < 3:
        return roles.frozen_bytes
    world = setup.world_size
    sixteen = 0 if setup.offload_params else 2 * roles.frozen_16bit / world
    # FSDP's CPU offload moves every parameter, the NF4 codes stored as 16-bit values too; DeepSpeed's keeps them
    packed = 0 if setup.offload_params and setup.framework != "deepspeed" else roles.nf4_packed_bytes / world
    return int(sixteen + packed + roles.nf4_state_bytes)


def model_state_bytes(setup: TrainSetup, counts: ParamCounts | None = None) -> dict[str, int]:
    """16-bit params, gradients and optimizer states per GPU, the ZeRO-3 gathered layer and a fine-tune's frozen base.

    DeepSpeed's accounting (its estimators, ZeRO paper), bytes per trained parameter: 2 for 16-bit params;
    optimizer 12 = fp32 master 4 + Adam m 4 + v 4 over the partition (8-bit Adam: 4 + 2.03); grads 6 over the
    partition for ZeRO-1/2 (16-bit partition 2 + fp32 4), 4 for ZeRO-3 (the fp32 copy; the 16-bit partition is the
    separate `zero3_grad_partition` part, which DeepSpeed's ZeRO-3 estimate leaves out); ZeRO-0
    keeps full 16-bit grads (2) and builds full fp32 grads (4) for the step. ZeRO-3 gathers up to
    4 bytes x the largest layer, frozen or not. A paged optimizer's states are counted apart
    (`paged_optimizer_states`): they live in managed memory that pages to the host, outside the peak.
    """
    c = counts or count_params(setup.spec)
    local, partition = _sizes(setup, trained_counts(setup, c))
    stage = setup.zero_stage
    live = 0.0
    paged = is_paged(setup.optimizer)
    pure = setup.precision == "pure"  # no master copy, 16-bit gradients only, moments in the weights' dtype
    states = state_bytes_per_param(setup.optimizer, setup.precision)
    per_param = (0 if pure else MASTER_BYTES) + (0 if paged else states)
    updated = local if stage == 0 else partition
    paged_states = states * updated if paged else 0.0
    if stage == 0:
        params, grads, optim = 2 * local, (2 if pure else 6) * local, per_param * local
    elif stage in (1, 2):
        params, grads, optim = 2 * local, (2 if pure else 6) * partition, per_param * partition
    elif stage == 3:
        params, grads, optim = 2 * partition, (2 if pure else 4) * partition, per_param * partition
        live = (4 * c.largest_layer / setup.tp_size if setup.framework == "deepspeed"  # AutoTP shards it too
                else fsdp_gathered_bytes(setup, c))
    else:
        raise ValueError(f"zero_stage must be 0-3, got {stage}")
    if setup.optimizer_in_backward:
        # stepped in backward, parameter by parameter: only one gradient exists at a time (`_assemble`)
        grads = 0.0
    if setup.offload_optimizer:
        # grads stream to the CPU in buckets; fp32 master, moments and grads live in host RAM (or on NVMe)
        grads, optim, paged_states = 0.0, 0.0, 0.0
    if setup.offload_params:
        params = 0.0  # ZeRO-3 fetches each layer from host RAM into the gathered-layer buffer
    # hpZ (ZeRO++): a secondary 16-bit copy of the parameters, partitioned over zero_hpz GPUs of a node,
    # that backward gathers from within the node (partition_parameters.py _partition_param_sec: param.dtype)
    secondary = 2 * local / setup.zero_hpz if stage == 3 and setup.zero_hpz > 1 and not setup.offload_params else 0.0
    out = {"params": int(params), "grads": int(grads), "optimizer": int(optim),
           "zero3_live_params": int(live), "hpz_secondary_params": int(secondary)}
    if setup.framework == "fsdp" and stage == 3:
        out["fsdp_root_params"] = fsdp_root_bytes(setup, c)
    if not trains_everything(setup.finetune):
        out["frozen_params"] = frozen_bytes_per_gpu(setup, param_roles(setup.spec, setup.finetune))
    if paged:
        out["paged_optimizer_states"] = int(paged_states)
    return out


def unit_bytes(setup: TrainSetup, params: int, quantized_weights: int = 0) -> float:
    """An FSDP unit's parameters unsharded: 16-bit, or NF4 codes (stored as 16-bit values for FSDP, fsdp_qlora's and
    PEFT's quant_storage) for its quantized weights, with their quantization state."""
    if not quantized_weights:
        return 2.0 * params
    return 2.0 * (params - quantized_weights) + quantized_weights / 2 + quantized_weights / 64


def fsdp_gathered_bytes(setup: TrainSetup, counts: ParamCounts) -> int:
    """FSDP's unsharded parameters beside the shards (FRAMEWORKS): two units whole, the one running and the one
    prefetched (FSDP1's limit_all_gathers allows two in flight; FSDP2 prefetches one), each the largest unit: a
    decoder layer, and under fsdp_sharded_root also the embedding and the output, units of their own. Each is a
    full-size buffer the all-gather fills, beside the shard the GPU keeps."""
    roles = param_roles(setup.spec, setup.finetune)
    layers = setup.spec.num_hidden_layers
    layer = max(counts.per_layer) if counts.per_layer else 0
    largest = unit_bytes(setup, layer, roles.frozen_4bit // layers if roles.frozen_4bit else 0)
    if setup.framework == "fsdp_sharded_root":
        largest = max(largest, 2.0 * setup.spec.vocab_size * setup.spec.hidden_size)
    return int(2 * largest) if setup.world_size > 1 else 0


def fsdp_root_bytes(setup: TrainSetup, counts: ParamCounts) -> int:
    """FSDP1's root unit (embedding, untied head, final norm) kept whole, beside its shard, from the forward through
    the backward."""
    root = counts.embedding + setup.spec.hidden_size
    return int(2 * root) if setup.world_size > 1 else 0


def host_bytes_per_node(setup: TrainSetup, counts: ParamCounts | None = None) -> int:
    """Host RAM for offloaded states, DeepSpeed's estimator formulas (zero_init=True for ZeRO-3): per trained
    parameter the fp32 master, the optimizer's states and the fp32 gradient (16 bytes with Adam), and with parameter
    offload 2 bytes for every 16-bit parameter, frozen ones included."""
    if not (setup.offload_optimizer or setup.offload_params):
        return 0
    if setup.offload_device == "nvme":  # pinned swap buffers and what DeepSpeed keeps in host RAM (nvme.py)
        return nvme_estimate(setup).host_bytes_per_node
    c = trained_counts(setup, counts or count_params(setup.spec))
    p = c.total
    pure = setup.precision == "pure"
    # master, moments, fp32 gradient (pure: the moments and the 16-bit gradient)
    state = (0 if pure else MASTER_BYTES) + state_bytes_per_param(setup.optimizer, setup.precision) + (2 if pure else 4)
    if setup.zero_stage == 3:
        held = state * p + (2 * (p + param_roles(setup.spec, setup.finetune).frozen_16bit) if setup.offload_params
                            else 0)
        return int(held / setup.num_nodes * HOST_BUFFER_FACTOR)
    # ZeRO-1/2 with optimizer offload: max(4 bytes x GPUs, 16) per param of a replica, the GPUs being the
    # group that replicates it (with AutoTP: per TP slice of P/tp params over its world/tp GPUs, tp slices).
    # Routed experts are replicated only over the expert-data-parallel group (ep_size times fewer GPUs):
    # each is one expert-parallel shard's, not every GPU's.
    expert_group = max(1, setup.zero_group_size // setup.ep_size)
    per_replica = (p - c.expert) * max(4 * setup.zero_group_size, state) + c.expert * max(4 * expert_group, state)
    return int(per_replica * HOST_BUFFER_FACTOR / setup.num_nodes)


def nvme_setup(setup: TrainSetup) -> NvmeSetup:
    """The ZeRO-Infinity view of a setup that offloads to NVMe (what ds_config/nvme.py writes for it)."""
    return _nvme_setup(setup.spec, setup.finetune, setup.zero_group_size, setup.gpus_per_node, setup.offload_params,
                       setup.gradient_checkpointing)


@lru_cache(maxsize=256)
def _nvme_setup(spec: ModelSpec, finetune: Finetune | None, partition_size: int, ranks_per_node: int,
                params_on_nvme: bool, recompute: bool) -> NvmeSetup:
    return NvmeSetup(tensors=zero_tensors(spec, finetune), partition_size=partition_size,
                     ranks_per_node=ranks_per_node, params_on_nvme=params_on_nvme, recompute=recompute)


def nvme_estimate(setup: TrainSetup) -> NvmeEstimate:
    """ZeRO-Infinity's host RAM, NVMe files and traffic for a setup that offloads to NVMe."""
    return _nvme_estimate(nvme_setup(setup), setup.nvme or DEFAULT_DRIVE)


@lru_cache(maxsize=256)
def _nvme_estimate(s: NvmeSetup, drive: NvmeDrive) -> NvmeEstimate:
    return estimate_nvme(s, drive)


def reduce_bucket_elements(counts: ParamCounts) -> int:
    """The gradient bucket we configure: 200M elements, or the model size if smaller."""
    return min(REDUCE_BUCKET_ELEMENTS, counts.total)


def comm_buffer_bytes(setup: TrainSetup, counts: ParamCounts | None = None) -> int:
    """DeepSpeed's communication buckets: ours are capped by the size of what they carry (the trained parameters'
    gradients, and under ZeRO-1/2 their updated 16-bit values); a user's ds_config's are allocated at the size it
    gives (DeepSpeed's `torch.empty(reduce_bucket_size)`)."""
    c = trained_counts(setup, counts or count_params(setup.spec))
    b = setup.bytes_per_param
    if setup.framework != "deepspeed":
        return torch_buffer_bytes(setup, c)
    reduce_elems = setup.reduce_bucket_elements or reduce_bucket_elements(c)
    if setup.zero_stage in (1, 2):
        # an all-gather bucket for the updated params when there is more than one GPU, plus the
        # reduce buckets (reduce_bucket_bytes), which live during backward only
        gather_elems = setup.allgather_bucket_elements or ALLGATHER_BUCKET_ELEMENTS
        gather = min(gather_elems, c.total) * b if setup.world_size > 1 else 0
        return int(reduce_bucket_bytes(setup, c) + gather)
    if setup.zero_stage == 3:
        prefetch = setup.prefetch_bucket_elements or STAGE3_PREFETCH_ELEMENTS
        return int(reduce_elems * b + min(prefetch, c.total) * b)
    return 0


def torch_buffer_bytes(setup: TrainSetup, trained: ParamCounts) -> int:
    """PyTorch's own gradient buffers (FRAMEWORKS): DDP's buckets, a 16-bit copy of every trained parameter's
    gradient, allocated when DDP wraps the model; FSDP's unsharded gradient of the unit whose backward runs (its
    trained parameters), in backward only. `trained`: the trained parameters' counts."""
    if setup.world_size == 1:
        return 0
    b = setup.bytes_per_param
    if setup.framework == "torch":
        return int(b * trained.total)
    if setup.zero_stage == 0:  # NO_SHARD: gradients all-reduced in place
        return 0
    layers = setup.spec.num_hidden_layers
    return int(b * trained.total / layers)


def reduce_bucket_bytes(setup: TrainSetup, counts: ParamCounts | None = None) -> int:
    """ZeRO-1/2's gradient reduce buckets. DeepSpeed allocates the whole configured bucket (16-bit) at
    the first gradient of a backward pass, twice with overlap_comm (double-buffered), and frees them
    when the backward's reduction ends (stage_1_and_2.py: `setup_buckets`, `_release_ipg_buffers`):
    so they coexist with the activations but not with the optimizer step. Measured with real engines:
    tests/plan/estimate/test_memory_measured_deepspeed.py, and for a user's 5e8 vs 2e8 buckets
    tests/plan/estimate/test_memory_measured_deepspeed_inputs.py. FSDP: its unit's unsharded gradient
    (`torch_buffer_bytes`), also in backward only."""
    if setup.framework in ("fsdp", "fsdp_sharded_root"):
        c = trained_counts(setup, counts or count_params(setup.spec))
        return torch_buffer_bytes(setup, c)
    if setup.framework != "deepspeed" or setup.zero_stage not in (1, 2):
        return 0
    c = trained_counts(setup, counts or count_params(setup.spec))
    elements = setup.reduce_bucket_elements or reduce_bucket_elements(c)
    return int((2 if setup.overlap_comm else 1) * elements * setup.bytes_per_param)


def estimate_memory(setup: TrainSetup) -> MemoryEstimate:
    """The per-GPU peak of a training step, its parts, and when it happens. Under pipeline parallelism, the
    worst stage's (pipeline.py): its own layers' model states, and its micro-batches in flight."""
    counts = count_params(setup.spec)
    ckpt = setup.gradient_checkpointing
    policy = setup.checkpointing
    if setup.calibration is not None and policy not in ("off", "full"):
        raise AdaptiveError(f"a calibration file covers checkpointing off and full, not {policy!r}")
    # Ulysses SP: each rank keeps its 1/sp of the sequence outside attention, and inside it all of the
    # sequence for heads/sp: activations and the loss are those of seq/sp tokens (SDPA; MoD is refused)
    sp, tp = setup.sp_size, setup.tp_size
    local_seq = setup.seq_len // sp
    tokens = local_seq * setup.micro_batch_size
    if setup.calibration is not None:
        saved = setup.calibration.activation_bytes(tokens, ckpt)
        backward_peak = setup.calibration.backward_bytes(tokens, ckpt)
    else:
        stack_loss = {} if setup.loss is None else {"loss": setup.loss}
        saved = activation_bytes(setup.spec, local_seq, setup.micro_batch_size, policy, setup.capacity_factor,
                                 setup.kernels, setup.finetune, **stack_loss)
        backward_peak = backward_peak_bytes(setup.spec, local_seq, setup.micro_batch_size, policy,
                                            setup.capacity_factor, setup.kernels, setup.finetune, **stack_loss)
    if setup.activation_offload:
        # the layers' saved tensors wait in host memory; one layer's at a time is back on the GPU (the one whose
        # backward runs, or, at the loss's backward, the top one prefetched); the head's and the loss's stay
        head = min(saved, head_saved_bytes(setup.spec, local_seq, setup.micro_batch_size, policy, setup.kernels,
                                           setup.finetune, setup.loss))
        layers = saved - head
        offloaded = int(layers - layers / setup.spec.num_hidden_layers)
        saved, backward_peak = saved - offloaded, backward_peak - offloaded
    if tp > 1:
        # AutoTP: the layers' activations inside the sharded matmuls split tp ways (parallel.py); the
        # column-parallel lm_head gathers its output, so the loss keeps whole-vocabulary logits
        loss_part = min(saved, tokens * loss_saved_bytes_per_token(setup.spec, setup.kernels, setup.loss))
        layers = saved - loss_part
        extra = backward_peak - saved
        saved = int(layers * tp_activation_factor(tp)) + loss_part
        backward_peak = saved + extra
    # Eager attention: its score-sized tensors (attention.py), kept by the blocks that are not checkpointed,
    # recomputed one layer at a time by those that are (the mlp policy keeps attention)
    scores_saved = scores_recompute = 0
    if setup.attention == "eager" and counts_ops(setup.spec, setup.kernels, setup.finetune):
        # transformers' classes counted op by op (hf_blocks.py): Gemma 2's soft cap, a fine-tune's frozen weights
        split = sp * tp
        scores_saved = eager_extra_bytes(setup.spec, setup.seq_len, setup.micro_batch_size, policy, setup.kernels,
                                         setup.finetune) // split
        scores_recompute = eager_backward_extra_bytes(setup.spec, setup.seq_len, setup.micro_batch_size, policy,
                                                      setup.kernels, setup.finetune) // split
    elif setup.attention == "eager":
        kept = 0.0 if policy == "full" else 1 - 1 / int(policy.split(":")[1]) if policy.startswith("every:") else 1.0
        # score-sized tensors span the whole sequence for heads/sp (Ulysses) or heads/tp (AutoTP)
        split = sp * tp
        if kept < 1:
            scores_recompute = eager_recompute_bytes(setup.spec, setup.seq_len, setup.micro_batch_size) // split
        scores_saved = int(kept * eager_extra_saved_bytes(setup.spec, setup.seq_len, setup.micro_batch_size) / split)
    if setup.pp_size == 1:
        return _assemble(setup, counts, saved, backward_peak, scores_saved, scores_recompute, True)
    # a stage holds its blocks' share of a micro-batch's activations for each micro-batch in flight; the head's
    # (final norm, head input, the loss's own) only on the last stage, which has one in flight
    head = min(saved, head_bytes(setup.spec, local_seq, setup.micro_batch_size, setup.kernels, loss=setup.loss))
    layers, extra = saved - head, backward_peak - saved
    worst = None
    for stage in partition_stages(setup.spec, setup.pp_size):
        share = stage.blocks / setup.spec.num_hidden_layers
        held = in_flight(stage.index, setup.pp_size, setup.gradient_accumulation_steps)
        stage_saved = int(layers * share * held) + (head if stage.head else 0)
        stage_counts = replace(counts, total=stage.params, expert=stage.expert_params)
        est = _assemble(setup, stage_counts, stage_saved, stage_saved + extra, int(scores_saved * share * held),
                        scores_recompute, stage.head)
        if worst is None or est.peak_gpu_bytes > worst.peak_gpu_bytes:
            worst = est
    assert worst is not None
    return worst


def _assemble(setup: TrainSetup, counts: ParamCounts, saved: int, backward_peak: int, scores_saved: int,
              scores_recompute: int, has_loss: bool) -> MemoryEstimate:
    """The parts and the peak, given the activations one GPU holds (`counts`: the parameters it holds a share of)."""
    local, partition = _sizes(setup, trained_counts(setup, counts))
    parts = model_state_bytes(setup, counts)
    offload = setup.offload_optimizer
    ds = setup.framework == "deepspeed"  # DeepSpeed's own buffers and copies (FRAMEWORKS)
    parts["zero3_grad_partition"] = int(2 * partition) if ds and setup.zero_stage == 3 and not offload else 0
    local_seq = setup.seq_len // setup.sp_size
    tokens = local_seq * setup.micro_batch_size

    parts["attention_scores"] = scores_saved
    if not has_loss:  # a pipeline stage before the last: no head, no loss
        loss = 0
        parts["activations"] = saved
    elif setup.kernels == "plain":
        # the loss keeps its fp32 log-softmax for backward; its backward working set is in the transient
        loss = min(saved, tokens * loss_saved_bytes_per_token(setup.spec, "plain", setup.loss))
        parts["activations"] = saved - loss
    else:
        # the chunked loss keeps nothing vocabulary-wide: its part is its backward working set (a tile of
        # logits, the head's input and weight gradients); the transient is what a layer's backward adds
        loss = min(backward_peak - saved, loss_working_bytes(setup.spec, tokens, "lean"))
        parts["activations"] = saved
    parts["logits_and_loss"] = loss
    parts["backward_transient"] = backward_peak - parts["activations"] - loss + scores_recompute
    parts["comm_buckets"] = comm_buffer_bytes(setup, counts)
    # QLoRA: each 4-bit weight is dequantized to 16 bits for its matmul, forward and backward, one at a time
    roles = param_roles(setup.spec, setup.finetune)
    if roles.largest_4bit_linear:
        parts["dequantized_weight"] = dequantized_bytes(roles.largest_4bit_linear, setup.bytes_per_param)
    # the optimizer's own temporaries during its step (foreach AdamW: an fp32 copy of what it updates)
    updated = local if setup.zero_stage == 0 else partition
    parts["optimizer_transient"] = step_transient_bytes(setup.optimizer, updated, offload, setup.precision,
                                                        setup.bytes_per_param)
    if setup.optimizer_in_backward:
        # each parameter steps as its gradient is made, then frees it: the largest one's gradient and its step's
        # temporaries are what backward adds (an adapter's are negligible)
        one = counts.largest_layer if trains_everything(setup.finetune) else 0
        one = one / setup.world_size if setup.zero_stage == 3 else one
        element = setup.bytes_per_param if setup.precision == "pure" else 4
        parts["optimizer_transient"] = int(setup.bytes_per_param * one
                                           + TRANSIENT_COPIES[setup.optimizer] * element * one)
    if ds and setup.fp16 and setup.zero_stage == 0:
        # DeepSpeed's FP16_Optimizer.step (runtime/fp16/fused_optimizer.py) builds the flat fp32 gradient as
        # _flatten_dense_tensors([p.grad.to(fp32) ...]): per-parameter fp32 copies (4 bytes/param) alive
        # beside the flat result while it concatenates. Read from DeepSpeed 0.19.8's code, not measured:
        # its CPU accelerator runs no fp16.
        parts["optimizer_transient"] += int(4 * local)

    # Which gradient bytes persist: ZeRO-1/2 keep a 16-bit partition buffer between steps and build
    # the fp32 copy only for the step; ZeRO-0 frees its 16-bit grads after each step.
    grads_persistent = 2 * partition if ds and setup.zero_stage in (1, 2) and not offload else 0
    # ZeRO-0 and ZeRO-1 reduce gradients only at the accumulation boundary (DeepSpeed's stage_1_and_2:
    # `partition_gradients or is_gradient_accumulation_boundary()`; plain DDP alike), so between
    # boundaries every local parameter's 16-bit gradient stays on the GPU, offload or not, and from the
    # second micro-batch on it coexists with the activations, beside ZeRO-1's own partition buffer
    # (measured with a real engine: tests/plan/estimate/test_memory_measured_deepspeed.py). ZeRO-2/3 reduce
    # every micro-batch.
    held = 0
    if setup.gradient_accumulation_steps > 1 and setup.zero_stage in (0, 1):
        held = int(2 * local)
    parts["accumulated_grads"] = held
    buckets_backward = reduce_bucket_bytes(setup, counts)  # ZeRO-1/2 reduce buckets: backward only
    persistent = (parts["params"] + parts["optimizer"] + parts["comm_buckets"] - buckets_backward
                  + parts["zero3_grad_partition"] + parts["hpz_secondary_params"] + grads_persistent
                  + parts.get("frozen_params", 0))
    backward = (parts["activations"] + parts["attention_scores"] + parts["logits_and_loss"]
                + parts["backward_transient"] + parts["zero3_live_params"] + held + buckets_backward
                + parts.get("dequantized_weight", 0) + parts.get("fsdp_root_params", 0))
    if setup.optimizer_in_backward:
        backward += parts["optimizer_transient"]
    if ds and setup.zero_stage == 0 and not offload and not held:
        # ZeRO-0 builds the 16-bit gradients during backward; they are complete when it ends
        backward = max(backward, parts["params"])
    elif not ds and not offload and not held and not setup.optimizer_in_backward:
        # PyTorch builds each gradient in its .grad (FSDP: its shard) during backward; all exist when it ends
        backward = max(backward, parts["grads"])
    # The optimizer step, measured on DeepSpeed 0.19.8 engines (bf16, CPU; tests/plan/
    # test_memory_measured_deepspeed*.py): beyond the fp32 gradients, ZeRO-1/2 flatten the averaged 16-bit
    # gradient partition (that partition copy plus the flat copy: 2 x 2 bytes per partition param) before
    # the update; an optimizer temporary (foreach AdamW: 4 bytes) comes after those are freed, so the
    # larger of the two counts. ZeRO-3 frees 2 bytes per partition param before the update, ZeRO-0
    # nothing: foreach AdamW adds its 4 bytes net under ZeRO-0, 2 under ZeRO-3, none under ZeRO-1/2.
    flatten = 0
    step_extra = parts["optimizer_transient"]
    if ds and setup.zero_stage in (1, 2) and not offload:
        flatten = int(2 * setup.bytes_per_param * partition)
        step_extra = max(flatten, step_extra)
        # the averaged partition copy exists at the end of backward, beside the reduce buckets (and any
        # gradients held for accumulation), once the activations are freed
        backward = max(backward, buckets_backward + held + int(setup.bytes_per_param * partition))
    elif ds and setup.zero_stage == 3 and not offload:
        step_extra = max(0, step_extra - int(2 * partition))
    parts["step_flatten"] = flatten
    step = parts["grads"] - grads_persistent + step_extra
    if setup.optimizer_in_backward:
        step = 0  # no step after backward: it ran inside it
    allocated = persistent + max(backward, step)
    parts["fragmentation"] = int(math.ceil(FRAGMENTATION * allocated))
    parts["cuda_context"] = CUDA_CONTEXT_BYTES
    return MemoryEstimate(parts=parts, persistent_bytes=int(persistent), backward_bytes=int(backward),
                          step_bytes=int(step),
                          peak_gpu_bytes=int(allocated + parts["fragmentation"] + parts["cuda_context"]),
                          host_bytes_per_node=host_bytes_per_node(setup, counts), saved_bytes=int(saved),
                          nvme_bytes_per_node=nvme_estimate(setup).nvme_bytes_per_node if setup.offload_device == "nvme"
                          else 0)


def corrected(mem: MemoryEstimate, factor: float) -> MemoryEstimate:
    """The estimate with its allocated peak scaled by a measured factor (shown as its own part): a real run's
    measured peak over the predicted one (run_calibration.py, `adaptive fit --calibrate RUN_DIR`)."""
    if factor == 1.0:
        return mem
    allocated = mem.allocated_peak_bytes * factor
    parts = dict(mem.parts)
    parts["calibration_correction"] = int(allocated - mem.allocated_peak_bytes)
    parts["fragmentation"] = int(math.ceil(FRAGMENTATION * allocated))
    return replace(mem, parts=parts,
                   peak_gpu_bytes=int(allocated + parts["fragmentation"] + CUDA_CONTEXT_BYTES))
