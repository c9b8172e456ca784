"""What the user asked `fit` for: the model, the GPUs, every knob they pinned, and what the run buys (a frozen
request; None means "let the planner choose")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from adaptive.plan.architecture.presets import ModelSpec
from adaptive.plan.finetune.method import Finetune
from adaptive.plan.hardware.gpus import GPU
from adaptive.plan.quality.predict import LossModel
from adaptive.plan.search.tight import NO_HEADROOM, Headroom
from adaptive.record import record

if TYPE_CHECKING:  # a plain `adaptive fit` does not import them
    from adaptive.plan.estimate.calibration import Calibration
    from adaptive.plan.estimate.nvme import NvmeDrive


class DeepSpeedBuckets(Protocol):
    """What the search reads of a user's DeepSpeed JSON (`ds_config.reader.DsConfigInput` is one): the
    buffers DeepSpeed allocates from it. The knobs the file pins arrive as the request's own fields."""

    reduce_bucket_elements: int
    allgather_bucket_elements: int
    prefetch_bucket_elements: int

    def overlap_for(self, stage: int) -> bool: ...


@record
class FitRequest:
    """What the user asked for. None means "let the planner choose"."""

    spec: ModelSpec
    gpu: GPU
    gpus_per_node: int = 1
    num_nodes: int = 1
    seq_len: int = 2048
    min_seq_len: int | None = None  # shorter sequences are tried only down to this
    global_batch_tokens: int | None = None
    train_tokens: float | None = None
    zero_stage: int | None = None
    offload: str | None = None  # none | optimizer | all
    micro_batch_size: int | None = None
    grad_accum: int | None = None
    gradient_checkpointing: bool | None = None
    ep_size: int | None = None
    capacity_factor: float = 1.0
    mfu: float | None = None
    host_mem_bytes: int | None = None  # per node; default: 3x the node's GPU memory
    headroom: Headroom = NO_HEADROOM  # GPU memory every candidate leaves free (the CLI's default: tight.py's)
    calibration: Calibration | None = None  # measured activations (adaptive measure --save-calibration)
    optimizer: str = "auto"  # optimizers.OPTIMIZERS: the step's transient memory by implementation
    attention: str = "sdpa"  # sdpa | eager (eager keeps the score-sized tensors)
    ds_config: DeepSpeedBuckets | None = None  # a user's DeepSpeed JSON: buckets, overlap_comm (pins are merged in)
    peak_correction: float = 1.0  # measured/predicted allocated peak of a real run on this GPU (--calibrate RUN_DIR)
    compute_scale: float = 1.0  # measured/modelled compute time of a real run on this GPU (--calibrate RUN_DIR)
    calibrated: tuple[str, ...] = ()  # which figures are calibrated, and from what
    calibration_source: str | None = None  # --calibrate: "calibration file PATH" or "run folder PATH"
    kernels: str = "lean"  # lean: adaptive's models; plain: transformers' Llama-style ops (activations.py)
    stack: str = "eager"  # time only (op_times.STACKS): eager PyTorch + DeepSpeed, fused, compiled
    elementwise: str | None = None  # time only: a published run's elementwise ops ("native": GPT-2 under autocast)
    # off | full | selective (the planner picks among SELECTIVE_POLICIES) | a pinned policy (mlp, every:N);
    # None: gradient_checkpointing decides (None there too: the planner tries off, selective, full)
    checkpointing: str | None = None
    # beyond data parallelism (DeepSpeed): Ulysses sequence parallel, AutoTP tensor parallel, ZeRO++
    sp_size: int | None = None
    tp_size: int | None = None
    pp_size: int | None = None  # DeepSpeed's pipeline engine: stages (estimate/pipeline.py)
    zero_hpz: int | None = None  # zero_hpz_partition_size; 1 is off
    zero_quantized_weights: bool | None = None
    zero_quantized_gradients: bool | None = None
    # what the run buys: the law that predicts its loss (None: the default published law), the dataset's unique
    # tokens (None: unknown, taken as never repeated), and a pinned peak learning rate
    loss_model: LossModel | None = None
    unique_tokens: float | None = None
    lr: float | None = None
    # a fine-tune of a downloaded checkpoint (None: pretraining): its method, and the epochs over its dataset
    finetune: Finetune | None = None
    epochs: float | None = None
    nvme: NvmeDrive | None = None  # --nvme-gbps: ZeRO-Infinity's drive (with --nvme-path, which enables NVMe offload)
    nvme_path: str | None = None  # --nvme-path: the folder DeepSpeed swaps to
    # the training stack, where it is not adaptive's own (estimate/memory.py FRAMEWORKS and PRECISIONS,
    # estimate/activations.py LOSSES; the evidence corpus's fine-tunes set them): at their defaults they change nothing
    framework: str = "deepspeed"  # who holds and partitions the states: deepspeed | torch | fsdp | fsdp_sharded_root
    precision: str = "mixed"  # mixed: fp32 master weights and moments; pure: everything in 16 bits
    loss: str | None = None  # the loss's implementation (None: transformers' on plain kernels, the lean tiles on lean)
    optimizer_in_backward: bool = False  # torchtune's optimizer_in_bwd: each parameter stepped as its gradient is made
    activation_offload: bool = False  # torchtune's activation offloading: the layers' saved tensors in host memory

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.num_nodes

    @property
    def memory_knobs(self) -> tuple[tuple[str, object], ...]:
        """The stack knobs that differ from adaptive's own, as TrainSetup takes them (hashable)."""
        given = (("framework", self.framework, "deepspeed"), ("precision", self.precision, "mixed"),
                 ("loss", self.loss, None), ("optimizer_in_backward", self.optimizer_in_backward, False),
                 ("activation_offload", self.activation_offload, False))
        return tuple((name, value) for name, value, default in given if value != default)

    @property
    def usable_bytes(self) -> int:
        """What a candidate's peak may reach: the GPU's memory less the headroom."""
        return self.gpu.memory_bytes - self.headroom.bytes_of(self.gpu.memory_bytes)

    @property
    def adapted(self) -> bool:
        """LoRA or QLoRA: adapters on a frozen base."""
        return self.finetune is not None and self.finetune.adapted


__all__ = ["DeepSpeedBuckets", "FitRequest"]
