"""ZeRO-Infinity: ZeRO-3 with NVMe offload, as DeepSpeed 0.19.8 runs it. Host RAM, NVMe capacity and NVMe traffic,
in bytes, counted tensor by tensor the way DeepSpeed allocates and swaps them.

Two modes (the planner's `--offload`):
- `nvme`: optimizer states and 16-bit parameters on NVMe (`offload_optimizer` and `offload_param` device "nvme");
- `nvme-optimizer`: optimizer states on NVMe, the 16-bit parameter partitions on the GPU.

Where each term comes from (paths under deepspeed/runtime/, DeepSpeed 0.19.8):
- A tensor goes to NVMe only if its bytes reach max(MIN_AIO_BYTES, aio block_size): smaller ones stay in host RAM
  (swap_tensor/partitioned_param_swapper.py:100,136-142 for 16-bit partitions; swap_tensor/optimizer_utils.py:180,
  225-232 for optimizer sub-groups and gradients). A file holds its tensor padded to the I/O alignment
  (AIO_ALIGNED_BYTES x intra_op_parallelism; _io_aligned_numel in both swappers).
- ZeRO-3 splits each parameter into ceil(numel / partition_size) elements per rank (zero/partition_parameters.py
  :1693-1696, 1817). The optimizer walks the trainable partitions in sub-groups of about `sub_group_size` elements:
  one closes when it reaches that size (zero/stage3.py:1210-1233). Frozen parameters (a LoRA base) are partitioned
  and swapped like the rest (partition_parameters.py:1820-1826) but have no optimizer state (stage3.py: only
  `_get_trainable_parameter_groups` enter the sub-groups).
- Optimizer on NVMe, per rank: a pool of `buffer_count` pinned fp32 buffers, each the largest sub-group
  (optimizer_utils.py:185-190, utils.py:192); the ZeRO-3 gradient partitions of the trainable parameters in host RAM
  in the gradient-accumulation dtype, the model's 16-bit dtype unless `data_types.grad_accum_dtype` is set
  (stage3.py:791-795, 333 device=cpu under offload; engine.py:1806-1807); a sub-group too small to swap keeps its
  fp32 master, optimizer states and fp32 gradient in host RAM (stage3.py:1146-1160, 1336-1341). On NVMe: the fp32
  master and each optimizer state of every swappable sub-group (optimizer_utils.py:44-72, 391-416), and each
  trainable parameter's fp32 gradient partition, cut to the I/O alignment, the remainder and partitions under
  MIN_AIO_BYTES kept in memory (optimizer_utils.py:256-287, 452-477).
- Parameters on NVMe, per rank: a pool of `buffer_count` pinned 16-bit buffers of `buffer_size` elements
  (partitioned_param_swapper.py:104-131); one flat pinned 16-bit buffer holding the first `max_in_cpu` trainable
  elements, whole sub-groups only, which never go back to NVMe (stage3.py:888-911, 967-1003, 857-887); a pinned
  buffer the size of the largest sub-group for writing updated 16-bit partitions back when some sub-group did not fit
  (stage3.py:1005-1018, partitioned_param_swapper.py:393-398); and every 16-bit partition too small to swap, pinned
  (partition_parameters.py:1828-1840). On NVMe: every swappable 16-bit partition, trainable ones included (their
  files stay after the trainable ones move into the flat buffer).
- Traffic. A micro-batch's forward reads every 16-bit partition held on NVMe, and its backward reads them again
  (partition_parameters.py:1707-1720 swaps in before each all-gather; a released partition gives its buffer back,
  partition_parameters.py:1807-1809; ds_config/nvme.py sets stage3_max_reuse_distance 0, so each is released after
  use), except a frozen input embedding, twice under full checkpointing. Measured (/work/nvme_check, a 12M-parameter
  Llama): exact for LoRA; for a full fine-tune an upper bound, ZeRO-3's trace-driven prefetch from the second step
  on kept some partitions gathered (27.3 MB counted, 19.9 MB read). An optimizer step writes each swappable gradient
  partition at the
  accumulation boundary (stage3.py:2041-2053), reads master, states and gradient of each swappable sub-group and
  writes master and states back (partitioned_optimizer_swapper.py:72-98, 134-151), and writes back the updated
  16-bit partitions that live on NVMe (stage3.py:1271-1289, partitioned_param_swapper.py:400-415).

Per node: every rank of the node has its own swap folder (`.../rank{r}`) and its own buffers; all of a node's ranks
are assumed to share that node's drive. Pinned memory cannot be paged out: the host RAM here must be free RAM.
"""

from __future__ import annotations

from adaptive.plan.architecture.families import linear_modules, resolve_targets
from adaptive.plan.architecture.params import count_params
from adaptive.plan.architecture.presets import ModelSpec
from adaptive.plan.finetune.method import Finetune
from adaptive.record import record

GB = 10**9  # drive makers' gigabyte (read/write speeds are given in GB/s)

# DeepSpeed 0.19.8's own constants.
MIN_AIO_BYTES = 1024**2  # swap_tensor/utils.py:14: a tensor smaller than this is never swapped
AIO_ALIGNED_BYTES = 1024  # swap_tensor/utils.py:15: each intra-op I/O thread's alignment

# What every ZeRO-Infinity ds_config of ours sets (ds_config/nvme.py writes these; the formulas below assume them).
AIO_BLOCK_SIZE = 1024**2  # DeepSpeed's default (swap_tensor/constants.py:20); equal to MIN_AIO_BYTES
AIO_QUEUE_DEPTH = 8  # DeepSpeed's default (constants.py:22)
AIO_INTRA_OP_PARALLELISM = 1  # DeepSpeed's default (constants.py:24); `thread_count` is no longer read in 0.19.8
AIO_SINGLE_SUBMIT = False  # DeepSpeed's default (constants.py:26)
AIO_OVERLAP_EVENTS = True  # DeepSpeed's default (constants.py:28)
OPTIMIZER_BUFFER_COUNT = 4  # DeepSpeed's default (zero/offload_config.py): Adam swaps in a sub-group's fp32 master,
#                             m, v and gradient at once (partitioned_optimizer_swapper.py:79-83), so 4 is the least
PARAM_BUFFER_COUNT = 5  # DeepSpeed's default (offload_config.py): partitions swapped in at once (one module's, plus
#                         the NVMe prefetch, which takes only free buffers: partitioned_param_coordinator.py:667-690)
MAX_IN_CPU_ELEMENTS = 10**9  # DeepSpeed's default (offload_config.py): trainable 16-bit elements kept in host RAM
SUB_GROUP_ELEMENTS = 10**8  # ours: DeepSpeed's 1e9 default would pin 4 buffers x 4 B x 1e9 = 16 GB per rank for the
#                             optimizer pool; 1e8 pins 1.6 GB and keeps every sub-group's files far above 1 MiB
ADAM_STATES = 2  # exp_avg, exp_avg_sq (DeepSpeedCPUAdam and torch AdamW; the scalar `step` is never swapped)

Run = tuple[int, int]  # (elements of one tensor, how many such tensors in a row)


@record
class NvmeDrive:
    """One node's NVMe drive (or RAID) as the swap files see it: sequential read and write speeds."""

    read_gbps: float  # GB/s (10^9 bytes)
    write_gbps: float
    source: str

    def read_seconds(self, nbytes: float) -> float:
        return nbytes / (self.read_gbps * GB)

    def write_seconds(self, nbytes: float) -> float:
        return nbytes / (self.write_gbps * GB)


# A PCIe 4.0 x4 data-centre NVMe as GPU servers carry them.
DEFAULT_DRIVE = NvmeDrive(
    read_gbps=6.5, write_gbps=3.5,
    source="Samsung PM9A3 U.2 (PCIe 4.0 x4), Samsung's figures: 6,500 MB/s sequential read, 3,500 MB/s sequential "
           "write (as reported at its launch, heise.de/-4720224, May 2020)")


@record
class ZeroTensors:
    """A model's parameter tensors as ZeRO-3 sees them, in model order: runs of (elements, how many)."""

    trainable: tuple[Run, ...]
    frozen: tuple[Run, ...] = ()
    input_embedding: int = 0  # elements of the input embedding (frozen, the backward never fetches it)

    @property
    def trainable_params(self) -> int:
        return sum(n * k for n, k in self.trainable)

    @property
    def frozen_params(self) -> int:
        return sum(n * k for n, k in self.frozen)


@record
class NvmeSetup:
    """A ZeRO-3 run with NVMe offload. Defaults are what ds_config/nvme.py writes."""

    tensors: ZeroTensors
    partition_size: int = 1  # GPUs one ZeRO-3 partition spans (the plan's zero_group_size)
    ranks_per_node: int = 1  # processes on one node (the plan's gpus_per_node)
    params_on_nvme: bool = True  # --offload nvme; False: nvme-optimizer (16-bit partitions stay on the GPU)
    sub_group_size: int = SUB_GROUP_ELEMENTS
    max_in_cpu: int = MAX_IN_CPU_ELEMENTS
    optimizer_buffer_count: int = OPTIMIZER_BUFFER_COUNT
    param_buffer_count: int = PARAM_BUFFER_COUNT
    param_buffer_size: int | None = None  # elements; None: what we write, param_buffer_elements()
    param_bytes: int = 2  # the model's 16-bit dtype
    trainable_bytes: int | None = None  # the trainable parameters' dtype, None: param_bytes. ZeRO-3's flat host
    #                                     buffers take it (stage3.py:238); PEFT adapters added after zero.Init stay
    #                                     fp32 (4), as measured in /work/nvme_check
    recompute: bool = False  # full activation checkpointing: the backward fetches each layer twice
    grad_accum_bytes: int = 2  # ZeRO-3's gradient partitions: the model dtype unless data_types.grad_accum_dtype
    master_bytes: int = 4  # fp32 master weights, optimizer states and the gradients the optimizer reads
    optimizer_states: int = ADAM_STATES
    aio_block_size: int = AIO_BLOCK_SIZE
    aio_intra_op_parallelism: int = AIO_INTRA_OP_PARALLELISM

    @property
    def min_swap_bytes(self) -> int:
        return max(MIN_AIO_BYTES, self.aio_block_size)

    def io_aligned(self, numel: int, element_bytes: int) -> int:
        """numel rounded up to the swappers' I/O alignment (_io_aligned_numel)."""
        a = AIO_ALIGNED_BYTES * self.aio_intra_op_parallelism // element_bytes
        return -(-numel // a) * a

    def partition(self, numel: int) -> int:
        """One rank's share of a tensor: ceil(numel / partition_size) (partition_parameters.py:1693-1696)."""
        return -(-numel // self.partition_size)

    @property
    def trainable_element_bytes(self) -> int:
        return self.param_bytes if self.trainable_bytes is None else self.trainable_bytes

    def param_swappable(self, partition: int, element_bytes: int | None = None) -> bool:
        return partition * (element_bytes or self.param_bytes) >= self.min_swap_bytes


@record
class NvmeTraffic:
    """Bytes one node reads from and writes to its NVMe."""

    read_bytes: int
    write_bytes: int

    def seconds(self, drive: NvmeDrive) -> float:
        """The least time the drive needs: reads and writes one after the other at its sequential speeds."""
        return drive.read_seconds(self.read_bytes) + drive.write_seconds(self.write_bytes)


@record
class NvmeEstimate:
    """What ZeRO-Infinity needs beyond the GPU, per node, and the NVMe traffic that bounds its step time."""

    host_parts: dict[str, int]  # per node, each part of the pinned / host RAM
    nvme_parts: dict[str, int]  # per node, swap files on NVMe
    host_bytes_per_node: int
    nvme_bytes_per_node: int
    step: NvmeTraffic  # one optimizer step (the gradients written at the accumulation boundary included)
    micro_batch: NvmeTraffic  # one micro-batch's forward and backward
    param_buffer_size: int  # elements of each parameter swap buffer (what offload_param.buffer_size must be)
    drive: NvmeDrive

    def step_seconds(self, grad_accum: int) -> float:
        """A lower bound on one optimizer step's time from NVMe traffic alone (no overlap with compute assumed
        either way: the drive cannot do better)."""
        return self.step.seconds(self.drive) + grad_accum * self.micro_batch.seconds(self.drive)


# --- the model's tensors -------------------------------------------------------------------------------------------


def zero_tensors(spec: ModelSpec, finetune: Finetune | None = None) -> ZeroTensors:
    """`spec`'s parameter tensors in model order, as transformers' Llama-style classes register them (the input
    embedding; per decoder layer the attention's and the MLP's linears, then its norms; the final norm; the LM head),
    trainable and frozen as `finetune` splits them (None or full: all trainable; lora: PEFT's A and B of every
    targeted linear train, the 16-bit base is frozen). Parameters that are neither linears nor embeddings (norms,
    routers) are counted as hidden-size vectors: all are far under MIN_AIO_BYTES, so their exact shapes move only
    host RAM, by their bytes, and the sub-group cuts, by a few elements. ValueError for MoE models (they have no
    ZeRO-3 plans) and for qlora (a 4-bit base has no offload path: CPU offload of one is not supported either)."""
    if spec.is_moe:
        raise ValueError("ZeRO-Infinity plans are ZeRO-3 plans, and MoE plans stop at ZeRO-2")
    if finetune is not None and finetune.quantized:
        raise ValueError("qlora: a 4-bit base cannot be offloaded to NVMe")
    h, layers = spec.hidden_size, spec.num_hidden_layers
    embedding = spec.vocab_size * h
    head = [] if spec.tie_word_embeddings else [(embedding, 1)]

    def vectors(n: int) -> list[Run]:
        """n elements as hidden-size vectors (and one shorter one)."""
        return [r for r in ((h, n // h), (n % h, 1)) if r[0] and r[1]]

    per_layer: list[Run] = []  # the linears every layer has, in order
    rest: list[Run] = []  # linears only some layers have (MoD, hybrid patterns)
    for m in linear_modules(spec):
        if m.role == "head":
            continue
        shapes = [m.weight_params] + ([m.out_features] if m.bias else [])
        if m.count == layers:
            per_layer += [(n, 1) for n in shapes]
        else:
            rest += [(n, m.count) for n in shapes]
    c = count_params(spec)
    uniform = len(set(spec.layer_types)) == 1
    layer_small = c.per_layer[0] - sum(n * k for n, k in per_layer) if uniform and not rest else 0
    layer = per_layer + vectors(layer_small)  # the norms after the linears, as LlamaDecoderLayer registers them
    base: list[Run] = [(embedding, 1)] + layer * layers + rest
    small = c.total - sum(n * k for n, k in base) - sum(n * k for n, k in head)  # the final norm, routers
    if small < 0:
        raise ValueError(f"{spec.name}: its linears count more than count_params ({-small} more)")
    base += vectors(small) + head
    if finetune is None or not finetune.adapted:
        return ZeroTensors(trainable=tuple(base))  # a trainable input embedding is fetched by the backward too
    r = finetune.lora_rank
    adapters: list[Run] = []
    for m in resolve_targets(spec, finetune.lora_targets):
        adapters += [(r * m.in_features, m.count), (m.out_features * r, m.count)]  # A: r x in, B: out x r
    return ZeroTensors(trainable=tuple(adapters), frozen=tuple(base), input_embedding=embedding)


# --- per rank ------------------------------------------------------------------------------------------------------


@record
class _SubGroup:
    numel: int  # elements of its trainable partitions on one rank
    partitions: tuple[Run, ...]  # (partition elements, how many) of its parameters
    swappable: bool  # its fp32 tensors go to NVMe (stage3.py:1264-1269)
    in_cpu: bool  # its 16-bit partitions sit in the max_in_cpu flat buffer (params_on_nvme only)


def _sub_groups(s: NvmeSetup) -> list[_SubGroup]:
    """The optimizer's sub-groups on one rank (stage3.py:1210-1233): trainable partitions in order, a group closing
    once it reaches sub_group_size elements. Runs of equal tensors are cut arithmetically, not walked one by one."""
    groups: list[_SubGroup] = []
    current: list[Run] = []
    size = 0
    flat_used = 0
    # the flat 16-bit buffer: max_in_cpu elements, or all trainable ones if fewer (stage3.py:888-911)
    cap = min(s.max_in_cpu, _trainable_partition(s)) if s.params_on_nvme else None

    def close() -> None:
        nonlocal current, size, flat_used
        if not current:
            return
        in_cpu = cap is None or flat_used + size <= cap
        if cap is not None:
            flat_used += size  # stage3.py:999: the offset advances whether or not the group fitted
        swappable = size * s.master_bytes >= s.min_swap_bytes
        groups.append(_SubGroup(size, tuple(current), swappable, in_cpu))
        current, size = [], 0

    for numel, count in s.tensors.trainable:
        p = s.partition(numel)
        left = count
        while left:
            if p == 0:
                break
            # how many of these fit before the group reaches sub_group_size (the one that reaches it joins it)
            need = max(1, -(-(s.sub_group_size - size) // p))
            take = min(left, need)
            current.append((p, take))
            size += p * take
            left -= take
            if size >= s.sub_group_size:
                close()
    close()
    return groups


def _trainable_partition(s: NvmeSetup) -> int:
    return sum(s.partition(n) * k for n, k in s.tensors.trainable)


def param_buffer_elements(s: NvmeSetup) -> int:
    """The `offload_param.buffer_size` to write: the largest 16-bit partition that goes to NVMe, I/O-aligned.
    DeepSpeed asserts a swapped partition fits one buffer (partitioned_param_swapper.py:357) and reads one into a
    buffer of that size (:193-194); its 1e8 default fails on a Llama-3-8B embedding on one GPU (5.3e8)."""
    sizes = [s.partition(n) for n, k in (*s.tensors.trainable, *s.tensors.frozen) if k]
    largest = max((p for p in sizes if s.param_swappable(p)), default=0)
    return max(s.io_aligned(largest, s.param_bytes), s.io_aligned(1, s.param_bytes))


def _per_rank(s: NvmeSetup) -> tuple[dict[str, int], dict[str, int], NvmeTraffic, NvmeTraffic]:
    """(host parts, NVMe parts, step traffic, micro-batch traffic) of one rank."""
    groups = _sub_groups(s)
    trainable = _trainable_partition(s)
    fp32 = s.master_bytes
    tensors_per_group = 1 + s.optimizer_states  # fp32 master + each state
    host: dict[str, int] = {}
    nvme: dict[str, int] = {}

    # optimizer states on NVMe (both modes)
    largest_group = max((g.numel for g in groups), default=0)
    host["optimizer_swap_buffers"] = s.optimizer_buffer_count * s.io_aligned(largest_group, fp32) * fp32
    host["grad_partitions"] = trainable * s.grad_accum_bytes
    host["in_memory_optimizer"] = sum(g.numel for g in groups if not g.swappable) * fp32 * (tensors_per_group + 1)
    opt_files = sum(tensors_per_group * s.io_aligned(g.numel, fp32) * fp32 for g in groups if g.swappable)
    grad_files = 0
    align32 = AIO_ALIGNED_BYTES * s.aio_intra_op_parallelism // fp32
    for g in groups:
        if not g.swappable:
            continue
        for p, k in g.partitions:
            cut = p // align32 * align32  # the aligned part; the remainder stays in memory
            if p * fp32 >= s.min_swap_bytes and cut * fp32 >= s.min_swap_bytes:
                grad_files += cut * fp32 * k
    nvme["optimizer_states"] = opt_files
    nvme["gradients"] = grad_files
    step_read = opt_files + grad_files
    step_write = opt_files + grad_files
    mb_read = 0

    if s.params_on_nvme:
        b, tb = s.param_bytes, s.trainable_element_bytes  # the swapper's dtype; the trainable parameters' dtype
        buffer_size = s.param_buffer_size if s.param_buffer_size is not None else param_buffer_elements(s)
        host["param_swap_buffers"] = s.param_buffer_count * s.io_aligned(buffer_size, b) * b
        host["trainable_params_in_cpu"] = min(trainable, s.max_in_cpu) * tb
        spilled = [g for g in groups if not g.in_cpu]
        if spilled:  # sized by the largest sub-group of all, in the swapper's dtype (stage3.py:1005-1018)
            biggest = max(groups, key=lambda g: g.numel)
            host["param_write_back_buffer"] = sum(s.io_aligned(p, b) * k for p, k in biggest.partitions) * b
        small = sum(s.partition(n) * k for n, k in s.tensors.frozen if not s.param_swappable(s.partition(n))) * b
        small += sum(p * k for g in spilled for p, k in g.partitions if not s.param_swappable(p)) * tb
        host["small_param_partitions"] = small

        def file(p: int) -> int:
            return s.io_aligned(p, b) * b if s.param_swappable(p) else 0

        frozen_files = sum(file(s.partition(n)) * k for n, k in s.tensors.frozen)
        trainable_files = sum(file(s.partition(n)) * k for n, k in s.tensors.trainable)
        nvme["params"] = frozen_files + trainable_files
        spilled_files = sum(file(p) * k for g in spilled for p, k in g.partitions)
        # The forward swaps in every partition that lives on NVMe; the backward again, but for a frozen input
        # embedding (no gradient flows into it, so ZeRO-3's backward hooks never fetch it: measured), and twice
        # under full checkpointing (the recompute and the backward; measured on LoRA, an upper bound: with
        # prefetching on, a full fine-tune's trace kept the recompute's partitions gathered).
        resident = frozen_files + spilled_files
        frozen_embedding = file(s.partition(s.tensors.input_embedding)) if s.tensors.input_embedding and any(
            n == s.tensors.input_embedding for n, _ in s.tensors.frozen) else 0
        mb_read = resident + (2 if s.recompute else 1) * (resident - frozen_embedding)
        step_write += spilled_files
    return host, nvme, NvmeTraffic(step_read, step_write), NvmeTraffic(mb_read, 0)


def estimate_nvme(s: NvmeSetup, drive: NvmeDrive = DEFAULT_DRIVE) -> NvmeEstimate:
    """Host RAM, NVMe capacity and NVMe traffic of one node of a ZeRO-Infinity run."""
    host, nvme, step, mb = _per_rank(s)
    n = s.ranks_per_node
    host = {k: v * n for k, v in host.items() if v}
    nvme = {k: v * n for k, v in nvme.items() if v}
    buffer_size = s.param_buffer_size if s.param_buffer_size is not None else param_buffer_elements(s)
    return NvmeEstimate(
        host_parts=host, nvme_parts=nvme, host_bytes_per_node=sum(host.values()),
        nvme_bytes_per_node=sum(nvme.values()),
        step=NvmeTraffic(step.read_bytes * n, step.write_bytes * n),
        micro_batch=NvmeTraffic(mb.read_bytes * n, mb.write_bytes * n),
        param_buffer_size=buffer_size if s.params_on_nvme else 0, drive=drive)


def host_bytes_per_node(s: NvmeSetup) -> int:
    return estimate_nvme(s).host_bytes_per_node


def nvme_bytes_per_node(s: NvmeSetup) -> int:
    return estimate_nvme(s).nvme_bytes_per_node


__all__ = ["ADAM_STATES", "AIO_BLOCK_SIZE", "AIO_INTRA_OP_PARALLELISM", "AIO_OVERLAP_EVENTS", "AIO_QUEUE_DEPTH",
           "AIO_SINGLE_SUBMIT", "DEFAULT_DRIVE", "MAX_IN_CPU_ELEMENTS", "MIN_AIO_BYTES", "NvmeDrive", "NvmeEstimate",
           "NvmeSetup", "NvmeTraffic", "OPTIMIZER_BUFFER_COUNT", "PARAM_BUFFER_COUNT", "SUB_GROUP_ELEMENTS",
           "ZeroTensors", "estimate_nvme", "host_bytes_per_node", "nvme_bytes_per_node", "param_buffer_elements",
           "zero_tensors"]
