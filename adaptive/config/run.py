"""One typed run configuration: every option of `adaptive fit`, `adaptive launch` and the recipes,
defined once.

Each section is a frozen dataclass; each field is one command-line option, declared with `option()`:
its flag names, its help text, the commands that take it, and its range. Flag names stay flat
(`--micro-batch`, `--lr`) whatever section holds them. `adaptive.config.commandline` turns the fields
into typer options, so `fit --help`, `launch --help` and a recipe's `--help` print the same text for
the same option. Pure: no I/O, no torch, no typer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from dataclasses import field
from typing import Any, Iterator

from adaptive.errors import AdaptiveError, closest
from adaptive.record import record

FIT, LAUNCH, TRAIN, MEASURE, COMPARE, SCALE = "fit", "launch", "train", "measure", "compare", "scale"  # the commands
PLANNING = frozenset({FIT, LAUNCH, TRAIN})  # the planner's inputs: every command takes them
FIT_ONLY = frozenset({FIT})  # what-if figures of the estimate (a run measures its own)
SHAPE = PLANNING | {MEASURE}  # what `adaptive measure` builds and runs, too
ESTIMATE = FIT_ONLY | {MEASURE}
WORLD = PLANNING | {COMPARE}  # the world and the run's length, which `adaptive compare` also takes
RUN = frozenset({LAUNCH, TRAIN})  # a training run's settings; launch hands them to the recipe
SWEEP = RUN | {SCALE}  # what `adaptive scale` hands to every point's run
LAUNCH_ONLY = frozenset({LAUNCH})  # how launch starts the run (a scheduler's batch job); never handed to the recipe


@record
class Flag:
    """How one field appears on the command line."""

    names: tuple[str, ...]
    help: str
    commands: frozenset[str]
    choices: tuple[str, ...] | None = None
    many: bool = False  # the value is a comma-separated list of `choices` ("tensorboard,wandb")
    minimum: float | None = None  # inclusive
    above: float | None = None  # exclusive lower bound
    maximum: float | None = None  # inclusive
    negative: str | None = None  # the flag that turns a bool off ("--no-checkpointing")
    bare: str | None = None  # the value of the flag given alone (`--resume` is `--resume auto`)
    pattern: tuple[str, str] | None = None  # a string's (full-match regex, what it allows), for values a shell sees
    unit: str | None = None  # "count" (20B, 1.5T) or "gib" (256GB, 1TiB): the number may carry a suffix (UNITS)
    panel: str = ""  # the --help section, set from the dataclass

    @property
    def name(self) -> str:
        return self.names[0]


def option(default: Any, *names: str, help: str, commands: frozenset[str], **rules: Any) -> Any:
    return field(default=default, metadata={"flag": Flag(names=names, help=help, commands=commands, **rules)})


@record
class ModelOptions:
    """The model: preset or HF config, architecture, kernels."""

    name: str | None = option(
        None, "--model", "-m", commands=SHAPE,
        help="Preset (debug, debug_200m, b1, b7, b14, b30, b70) or a path to an HF config.json; default: b7 "
             "for fit, the recipe's own preset for a run.")
    arch: str | None = option(
        None, "--arch", commands=SHAPE,
        help="dense | moe | mod | hybrid; default: dense, the config's, or the recipe's own.")
    init_from: str | None = option(
        None, "--init-from", commands=RUN,
        help="Start from a checkpoint folder (config.json + safetensors or pytorch_model.bin). A fine-tune "
             "(--finetune) trains transformers' own class of Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3, "
             "Mixtral, Qwen2-MoE or Qwen3-MoE. Pretraining from it: an adaptive export, or a Llama, Mistral, Qwen2 or "
             "Mixtral, as --arch or the recipe's arch (a dense checkpoint as moe/hybrid is sparse-upcycled, each "
             "expert a copy of its FFN; MoE and MoD routers start fresh). Its config.json is the shape (instead of "
             "--model). Its tokenizer is used (a downloaded one without is refused: --tokenizer). A --resume "
             "checkpoint wins over it.")
    capacity_factor: float = option(1.0, "--capacity-factor", commands=ESTIMATE, above=0.0,
                                    help="MoE capacity factor.")
    mod_capacity: float | None = option(None, "--mod-capacity", commands=ESTIMATE, above=0.0, maximum=1.0,
                                        help="MoD capacity (fraction of tokens routed).")
    attention: str | None = option(
        None, "--attention", commands=FIT_ONLY,
        help="Attention implementation: sdpa (or flash attention) | eager (keeps the scores). Default: sdpa; eager "
             "for Gemma 2, as transformers runs it (its class refuses sdpa, which cannot softcap).")
    kernels: str | None = option(
        None, "--kernels", commands=ESTIMATE, choices=("lean", "plain"),
        help="lean: adaptive's memory-lean RMSNorm, SwiGLU and chunked loss (what the recipes train); plain: "
             "transformers' Llama ops. Default: lean, plain for a config.json transformers' own class trains.")


@record
class HardwareOptions:
    """The GPUs: type, count, memory, price."""

    gpu: str | None = option(
        None, "--gpu", "-g", commands=SHAPE,
        help="GPU name or alias (see `adaptive gpus`); a run without it detects its GPU, or trains on the CPU.")
    gpus: int | None = option(
        None, "--gpus", commands=WORLD, minimum=1,
        help="GPUs per node to plan for (default 1); a training run takes its launcher's.")
    nodes: int | None = option(None, "--nodes", commands=WORLD, minimum=1,
                               help="Nodes to plan for (default 1); a training run takes its launcher's.")
    gpu_mem: float | None = option(None, "--gpu-mem", commands=ESTIMATE, above=0.0, unit="gib",
                                   help="Custom GPU memory in GiB (2^30 bytes), or with a unit: 80GB, 80GiB.")
    gpu_tflops: float | None = option(None, "--gpu-tflops", commands=ESTIMATE, above=0.0,
                                      help="Custom GPU peak dense 16-bit TFLOP/s.")
    price: float | None = option(None, "--price", commands=FIT_ONLY, minimum=0.0,
                                 help="USD per GPU hour (default: catalog price).")
    host_mem: float | None = option(None, "--host-mem", commands=FIT_ONLY, above=0.0, unit="gib",
                                    help="Host RAM per node in GiB (2^30 bytes), or with a unit: 256GB (1e9 bytes), "
                                         "256GiB, 1TiB (default 3x GPU memory).")
    headroom: str | None = option(
        None, "--headroom", commands=FIT_ONLY, pattern=(r"(\d+(\.\d*)?|\.\d+)\s*(%|[gG][iI][bB])?",
                                                       "GiB, or a percentage (10%)"),
        help="GPU memory every plan keeps free: GiB (2) or a percentage of the GPU's (10%). Default 13%: the largest "
             "peak under-prediction on published runs of this stack (adaptive/plan/search/tight.py); 0: the whole GPU.")
    mfu: float | None = option(None, "--mfu", commands=FIT_ONLY, above=0.0, maximum=1.0,
                               help="Override the assumed MFU (0-1].")


@record
class DataOptions:
    """Sequence length and the training data."""

    seq_len: int | None = option(
        None, "--seq-len", "--max-seq-len", commands=SHAPE | {COMPARE, SCALE}, minimum=1,
        help="Sequence length (default 2048; 128 for a run on a CPU). A run's data are blocks of it: keep it "
             "on --resume. Instruction examples longer than it are truncated (the run says how many).")
    min_seq_len: int | None = option(
        None, "--min-seq-len", commands=PLANNING, minimum=1,
        help="Shortest sequence allowed: fit tries 3/4, 1/2, ... of --seq-len down to it; a run's OOM ladder "
             "may halve the sequence down to it (default: keep the sequence).")
    dataset: str | None = option(
        None, "--dataset", commands=SWEEP,
        help="'c4', a hub dataset, a local .txt/.jsonl/.json/.parquet file or folder, a folder that "
             "`Dataset.save_to_disk` wrote, or 'builtin' (the shipped "
             "corpus); default: C4 on a GPU with the hub reachable, else builtin.")
    dataset_config: str | None = option(None, "--dataset-config", commands=RUN,
                                        help="Hub dataset config name (C4: en).")
    text_field: str = option("text", "--text-field", commands=SWEEP,
                             help="The text column of json/parquet/saved/hub data. Rows with `messages` (chats, "
                                  "rendered with the tokenizer's chat template) or `prompt` and `completion` are "
                                  "instruction data, trained on the answers only.")
    packing: bool = option(
        False, "--packing", commands=RUN, negative="--no-packing",
        help="Instruction data: pack several examples into each block, attention kept inside each example "
             "(default: one example per block, padded). Text is always packed. Keep it on --resume.")
    tokenizer: str | None = option(None, "--tokenizer", commands=SWEEP,
                                   help="Hub name or local folder; default: the built-in byte-level BPE (2048).")
    data_workers: int | None = option(
        None, "--data-workers", commands=RUN, minimum=0,
        help="Processes per GPU that read, tokenize and pack streamed data (0: the training process); default 1 "
             "on a CPU, 2 on a GPU. Local files are tokenized once up front and need none. Keep it on --resume.")


@record
class ScheduleOptions:
    """How long the run is, and its global batch."""

    tokens: float | None = option(
        None, "--tokens", commands=WORLD, above=0.0, maximum=1e15, unit="count",  # 1,000T: above any published run
        help="Training tokens: 2e10, or 20B, 1.5T, 500M, 10K (default 20 x active params; 100 steps for a run on a "
             "CPU).")
    max_steps: int | None = option(None, "--max-steps", commands=RUN, minimum=1,
                                   help="Optimizer steps to train (instead of --tokens).")
    global_batch_tokens: int | None = option(None, "--global-batch-tokens", commands=FIT_ONLY, minimum=1, unit="count",
                                             help="Global batch in tokens, e.g. 4M (default by size).")


@record
class QualityOptions:
    """The loss a run buys, and the best run a budget buys."""

    loss_law: str | None = option(
        None, "--loss-law", commands=FIT_ONLY | {COMPARE},
        help="The scaling law that predicts the final loss: epoch (default: Besiroglu et al.'s refit of Chinchilla's "
             "runs), chinchilla (Hoffmann et al. 2022, approach 3) or a law.json that `adaptive scale` fitted on "
             "your data.")
    dataset_tokens: float | None = option(
        None, "--dataset-tokens", commands=FIT_ONLY | {COMPARE}, above=0.0, maximum=1e15, unit="count",
        help="Unique tokens in your dataset (e.g. 50B): a run longer than it repeats data, which the loss prediction "
             "discounts (Muennighoff et al. 2023).")
    budget_usd: float | None = option(
        None, "--budget-usd", commands=FIT_ONLY, above=0.0, maximum=1e10,
        help="Find the model, arch and token count with the lowest predicted loss that this many dollars buy on "
             "--gpu x --gpus x --nodes.")
    budget_gpu_hours: float | None = option(None, "--budget-gpu-hours", commands=FIT_ONLY, above=0.0, maximum=1e9,
                                            help="As --budget-usd, in GPU-hours.")
    budget_days: float | None = option(None, "--budget-days", commands=FIT_ONLY, above=0.0, maximum=3650.0,
                                       help="As --budget-usd, in days of wall-clock time on the given GPUs.")
    max_params: float | None = option(
        None, "--max-params", commands=FIT_ONLY, above=0.0, maximum=1e13, unit="count",
        help="With a budget: consider only models with at most this many parameters in all, e.g. 3B (what serving "
             "costs).")


@record
class ParallelismOptions:
    """The DeepSpeed knobs the planner would otherwise choose."""

    zero: int | None = option(None, "--zero", commands=SHAPE, minimum=0, maximum=3,
                              help="Pin the ZeRO stage (0-3).")
    offload: str | None = option(
        None, "--offload", commands=PLANNING | {COMPARE}, choices=("none", "optimizer", "all", "nvme", "nvme-optimizer"),
        help="Pin offload: none, optimizer (its states to the CPU), all (and the parameters), or ZeRO-Infinity's nvme "
             "(states and parameters to an NVMe drive) or nvme-optimizer (the states alone), ZeRO-3 and --nvme-path.")
    nvme_path: str | None = option(
        None, "--nvme-path", commands=PLANNING | {COMPARE},
        help="A writable folder on an NVMe drive for ZeRO-Infinity's swap files: enables --offload nvme and "
             "nvme-optimizer (the planner tries them under ZeRO-3).")
    nvme_gbps: str | None = option(
        None, "--nvme-gbps", commands=PLANNING | {COMPARE}, pattern=(r"\d+(\.\d+)?(/\d+(\.\d+)?)?", "READ or READ/WRITE in GB/s"),
        help="The NVMe drive's sequential read/write GB/s, as READ/WRITE or one figure for both (default: a PCIe 4.0 "
             "drive's datasheet figures; measure yours with DeepSpeed's ds_nvme_tune).")
    micro_batch: int | None = option(None, "--micro-batch", commands=SHAPE | {SCALE}, minimum=1,
                                     help="Pin the micro-batch per GPU.")
    grad_accum: int | None = option(None, "--grad-accum", commands=PLANNING, minimum=1,
                                    help="Pin gradient accumulation steps.")
    ep_size: int | None = option(None, "--ep-size", commands=PLANNING, minimum=1,
                                 help="Pin the expert-parallel size (MoE).")
    sp_size: int | None = option(
        None, "--sp-size", commands=PLANNING, minimum=1,
        help="Pin the Ulysses sequence-parallel size (DeepSpeed's sequence parallel size): each GPU holds 1/sp "
             "of every sequence; the attention heads must divide by it.")
    tp_size: int | None = option(
        None, "--tp-size", commands=PLANNING, minimum=1,
        help="Pin the AutoTP tensor-parallel size (DeepSpeed's autotp_size), within a node.")
    pp_size: int | None = option(
        None, "--pp-size", commands=PLANNING, minimum=1,
        help="Pin the pipeline-parallel size (DeepSpeed's pipeline engine): the layers split into this many "
             "stages; the micro-batches per step are the gradient accumulation steps; ZeRO-1 at most.")
    zero_hpz: int | None = option(
        None, "--zero-hpz", commands=PLANNING, minimum=1,
        help="Pin ZeRO++ hpZ (DeepSpeed's hpz partition size): a secondary ZeRO-3 parameter copy sharded over "
             "this many GPUs of a node, so the backward all-gathers stay in the node; 1 is off.")
    zero_quantize: str | None = option(
        None, "--zero-quantize", commands=PLANNING, choices=("off", "weights", "gradients", "both"),
        help="Pin ZeRO++ quantized communication under ZeRO-3: off, weights (qwZ: int8 parameter all-gathers), "
             "gradients (qgZ: int4 reduce-scatter) or both.")
    pp_partition: str | None = option(
        None, "--pp-partition", commands=RUN,
        help="How --pp-size splits the layers into stages (DeepSpeed's partition_method): parameters (default: "
             "balance the parameter counts), uniform (the same number of layers), or type:REGEX (balance the layers whose "
             "class matches: type:Decoder).")
    ds_config: str | None = option(
        None, "--ds-config", commands=PLANNING,
        help="Your DeepSpeed JSON: its explicit values pin the knobs, bucket sizes and optimizer; its \"auto\" "
             "values are planned (a run fills them in).")


@record
class FinetuneOptions:
    """Fine-tuning a downloaded checkpoint: in full, or LoRA / QLoRA adapters on a frozen base."""

    finetune: str | None = option(
        None, "--finetune", commands=PLANNING | {COMPARE, MEASURE}, choices=("full", "lora", "qlora"),
        help="Fine-tune a checkpoint (fit: --model PATH/config.json; a run: --init-from PATH): full (every parameter), "
             "lora (PEFT LoRA on a frozen 16-bit base) or qlora (LoRA on a bitsandbytes NF4 base, double-quantized). "
             "Without it a plan is pretraining.")
    lora_rank: int | None = option(None, "--lora-rank", commands=PLANNING | {COMPARE, MEASURE}, minimum=1,
                                   help="LoRA rank r (default 16).")
    lora_alpha: float | None = option(None, "--lora-alpha", commands=PLANNING | {COMPARE, MEASURE}, above=0.0,
                                      help="LoRA alpha (default 2 x rank).")
    lora_targets: str | None = option(
        None, "--lora-targets", commands=PLANNING | {COMPARE, MEASURE},
        help="Linear layers LoRA adapts: all-linear (PEFT's: every nn.Linear but the output layer; default), "
             "attention, or module names as PEFT takes them (q_proj,v_proj).")
    lora_dropout: float | None = option(None, "--lora-dropout", commands=PLANNING | {COMPARE, MEASURE}, minimum=0.0,
                                        maximum=1.0,
                                        help="LoRA dropout (default 0, PEFT's); each target then keeps its own "
                                             "dropped copy of its input for backward.")
    epochs: float | None = option(None, "--epochs", commands=PLANNING | {COMPARE}, above=0.0, maximum=1000.0,
                                  help="Passes over the dataset (a fine-tune's default: 1): a run counts its steps "
                                       "from its examples; fit plans --dataset-tokens x --epochs tokens (10M, 1 epoch "
                                       "unless given).")


@record
class CheckpointingOptions:
    """Activation checkpointing."""

    gradient_checkpointing: bool | None = option(None, "--checkpointing", commands=SHAPE,
                                                 negative="--no-checkpointing", help="Pin activation checkpointing.")
    checkpoint_policy: str | None = option(
        None, "--checkpoint-policy", commands=SHAPE,
        help="Pin activation checkpointing: off, full, selective (the planner picks every:4, every:2 or mlp), or "
             "a policy: every:N (every N-th block), mlp (each block recomputes its MLP half, keeps attention).")


@record
class OptimizerOptions:
    """The optimizer and its schedule."""

    optimizer: str | None = option(
        None, "--optimizer", commands=PLANNING | {COMPARE},
        help="Optimizer implementation: auto (fused AdamW, as adaptive runs), adamw_torch (foreach), "
             "adamw_torch_fused, deepspeed_fused_adam, deepspeed_cpu_adam, or bitsandbytes' adamw_8bit and "
             "paged_adamw_8bit (8-bit moments; the paged one's spill to host RAM).")
    lr: float | None = option(None, "--lr", commands=SWEEP | FIT_ONLY, above=0.0,
                              help="Peak learning rate (default by preset: debug 3e-3, debug_200m 6e-4, b1 and "
                                   "larger 3e-4; a budget plan offers DeepSeek LLM's compute-optimal one).")
    warmup_steps: int | None = option(None, "--warmup-steps", commands=RUN, minimum=0,
                                      help="Linear warmup steps (default 5% of the run, at most 2000).")
    weight_decay: float = option(0.1, "--weight-decay", commands=RUN, minimum=0.0,
                                 help="AdamW weight decay on matrices.")
    seed: int = option(0, "--seed", commands=SWEEP, minimum=0, help="Model init and data order.")


@record
class OrchestratorOptions:
    """The adaptive orchestrator."""

    orchestrator: str = option("auto", "--orchestrator", commands=RUN, choices=("on", "off", "auto"),
                               help="Adaptive orchestrator: auto follows the plan's recommendation.")
    orchestrator_policies: str | None = option(
        None, "--orchestrator-policies", commands=RUN,
        help="Comma-separated policies the orchestrator runs (balance, capacity, oom, guard, ep, early_stop, or "
             "any other in its registry); 'all' (default) or 'none' (monitor and event log only).")
    orchestrator_config: str | None = option(
        None, "--orchestrator-config", commands=RUN,
        help="Policy settings as a JSON object or file, e.g. '{\"balance\": {\"rate\": 0.001}}' (fields: the "
             "*Config dataclasses in adaptive/orchestrator/).")


@record
class OutputOptions:
    """The run folder, checkpoints, logs and trackers."""

    output_dir: str | None = option(
        None, "--output-dir", "--run-dir", commands=RUN,
        help="Run folder: configs, metrics.jsonl, checkpoints/, hf/ (default runs/PRESET_ARCH).")
    resume: str | None = option(
        None, "--resume", commands=RUN, bare="auto",
        help="Continue from the newest complete checkpoint of --output-dir ('auto'; a folder that holds no run "
             "starts fresh, saying so), or of PATH; refused when there is none.")
    overwrite: bool = option(
        False, "--overwrite", commands=RUN,
        help="Start a fresh run in an --output-dir that holds one, deleting its metrics, events, trackers' logs, "
             "checkpoints and exports (without it that is refused). launch --dry-run: write the configs over the folder's.")
    trust_checkpoint: bool = option(
        False, "--trust-checkpoint", commands=RUN,
        help="Resume with the full unpickler instead of the weights-only one: only for a checkpoint you wrote "
             "yourself, whose files hold classes the weights-only loader refuses (unpickling can run code).")
    log_every: int = option(10, "--log-every", commands=RUN, minimum=1,
                            help="Log line and metrics record every N steps.")
    eval_every: int = option(0, "--eval-every", commands=RUN, minimum=0,
                             help="Eval every N steps (0: at the end only).")
    checkpoint_every: int = option(1000, "--checkpoint-every", commands=RUN, minimum=0,
                                   help="Checkpoint every N steps (0: at the end only).")
    keep_checkpoints: int = option(3, "--keep-checkpoints", commands=RUN, minimum=1, help="Checkpoints kept.")
    export_every: int = option(0, "--export-every", commands=RUN, minimum=0,
                               help="HF export every N steps into hf-step_N/ (0: at the end only; touch "
                                    "OUTPUT_DIR/EXPORT for one now).")
    progress: bool = option(True, "--progress", commands=RUN, negative="--no-progress",
                            help="Show a progress bar.")
    report_to: str = option(
        "none", "--report-to", commands=RUN, choices=("tensorboard", "wandb", "mlflow", "trackio", "all", "none"),
        many=True,
        help="Experiment trackers, comma-separated: tensorboard, wandb, mlflow, trackio; 'all' (every one installed) "
             "or 'none' (default). They get metrics.jsonl's numbers, the orchestrator's decisions and the run's "
             "options; tensorboard and wandb write under OUTPUT_DIR/trackers/.")


@record
class FaultOptions:
    """What a dead or hung process costs: the collective timeout and the launcher's restarts."""

    collective_timeout: float = option(
        600.0, "--collective-timeout", commands=RUN, above=0.0, maximum=86400.0,
        help="Seconds a process waits in one collective (all-reduce, barrier) for the other ranks before it stops, "
             "naming the rank it waited for; given to the process group DeepSpeed and accelerate create. Default 600 "
             "(DeepSpeed's own; torch's is 30 minutes): above the longest honest wait, the barrier while the main "
             "process digests a large checkpoint.")
    max_restarts: int = option(
        0, "--max-restarts", commands=LAUNCH_ONLY, minimum=0,
        help="Restart every process up to N times when one fails (torchrun's elastic agent: accelerate launch "
             "--max_restarts); a restarted run resumes from its newest verified checkpoint. DeepSpeed's pdsh "
             "launcher (--hostfile) restarts nothing.")


# What reaches an #SBATCH line: Slurm's own names (partition, account, QoS, job name) in plain characters.
_SLURM_NAME = (r"[A-Za-z0-9_.-]{1,64}", "letters, digits and _.- (at most 64)")
_SLURM_NAMES = (r"[A-Za-z0-9_.-]{1,64}(,[A-Za-z0-9_.-]{1,64}){0,15}", "comma-separated names of letters, digits and _.-")
# Slurm's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_SLURM_TIME = (r"\d{1,6}(:\d{1,2}){0,2}|\d{1,4}-\d{1,2}(:\d{1,2}){0,2}",
               "a Slurm time: MINUTES, HH:MM:SS or DAYS-HH[:MM[:SS]]")


@record
class SchedulerOptions:
    """A batch job for a cluster's scheduler: `adaptive launch --scheduler slurm` writes RUN/job.sbatch."""

    scheduler: str = option(
        "none", "--scheduler", commands=LAUNCH_ONLY, choices=("none", "slurm"),
        help="slurm: write RUN/job.sbatch (nodes, GPUs, CPUs, memory and time from the plan; srun starts one "
             "launcher per node) instead of running the launcher here; --submit submits it.")
    submit: bool = option(False, "--submit", commands=LAUNCH_ONLY,
                          help="With --scheduler slurm: submit the job with sbatch and record its id in "
                               "RUN/slurm_job.json (`adaptive status RUN` shows it).")
    partition: str | None = option(None, "--partition", commands=LAUNCH_ONLY, pattern=_SLURM_NAMES,
                                   help="Slurm partition(s) of the job.")
    account: str | None = option(None, "--account", commands=LAUNCH_ONLY, pattern=_SLURM_NAME,
                                 help="Slurm account charged for the job.")
    qos: str | None = option(None, "--qos", commands=LAUNCH_ONLY, pattern=_SLURM_NAME, help="Slurm QoS of the job.")
    job_name: str | None = option(None, "--job-name", commands=LAUNCH_ONLY, pattern=_SLURM_NAME,
                                  help="Slurm job name (default: PRESET_ARCH).")
    time: str | None = option(
        None, "--time", commands=LAUNCH_ONLY, pattern=_SLURM_TIME,
        help="Cap the job's time limit (e.g. your partition's, 2-00:00:00); default: the plan's predicted time "
             "+25% and 15 min to start. A run longer than it checkpoints at the limit (--requeue: and continues).")
    requeue: bool = option(
        False, "--requeue", commands=LAUNCH_ONLY,
        help="Requeue the job when preempted or when it reaches its time limit unfinished; a requeued job resumes "
             "from the run's newest complete checkpoint.")
    cpus_per_task: int | None = option(
        None, "--cpus-per-task", commands=LAUNCH_ONLY, minimum=1,
        help="CPUs of each node's launcher and its processes (default: per process, 1 + its data workers).")


PANELS = {  # section -> its --help panel
    "model": "Model", "hardware": "Hardware", "data": "Data and sequence", "schedule": "Length",
    "quality": "Quality and budget",
    "finetune": "Fine-tuning",
    "parallelism": "Knobs (pin what the planner would choose)", "checkpointing": "Knobs (pin what the planner would choose)",
    "optimizer": "Optimization", "orchestrator": "Orchestrator", "output": "Output, checkpoints, logs",
    "faults": "Faults and restarts", "scheduler": "Scheduler (Slurm)",
}


@record
class RunConfig:
    """A run, as the user gave it: None means "the planner's choice" or "the default"."""

    model: ModelOptions = field(default_factory=ModelOptions)
    hardware: HardwareOptions = field(default_factory=HardwareOptions)
    data: DataOptions = field(default_factory=DataOptions)
    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    quality: QualityOptions = field(default_factory=QualityOptions)
    finetune: FinetuneOptions = field(default_factory=FinetuneOptions)
    parallelism: ParallelismOptions = field(default_factory=ParallelismOptions)
    checkpointing: CheckpointingOptions = field(default_factory=CheckpointingOptions)
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    orchestrator: OrchestratorOptions = field(default_factory=OrchestratorOptions)
    output: OutputOptions = field(default_factory=OutputOptions)
    faults: FaultOptions = field(default_factory=FaultOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)

    @classmethod
    def from_options(cls, values: dict[str, Any]) -> RunConfig:
        """Build from flat option values (field name -> value), validating each; unknown names are refused."""
        by_section: dict[str, dict[str, Any]] = {}
        for section, f, flag in run_fields():
            if f.name in values:
                value = values[f.name]
                if flag.unit and isinstance(value, str):
                    value = quantity(flag, value, integer=f.type.startswith("int"))
                check(flag, value)
                by_section.setdefault(section, {})[f.name] = value
        unknown = set(values) - {f.name for _, f, _ in run_fields()}
        assert not unknown, f"not run options: {sorted(unknown)}"
        return cls(**{name: kind(**by_section.get(name, {})) for name, kind in _sections().items()})

    def flat(self) -> dict[str, Any]:
        """Field name -> value, over every section."""
        return {f.name: getattr(getattr(self, section), f.name) for section, f, _ in run_fields()}

    def replace(self, **values: Any) -> RunConfig:
        """A copy with some options changed (flat names), validated like the command line."""
        return RunConfig.from_options({**self.flat(), **values})


def run_fields() -> Iterator[tuple[str, dataclasses.Field, Flag]]:
    """(section, field, flag) for every option, in --help order."""
    return iter(_run_fields())


@functools.cache
def _sections() -> dict[str, type]:
    """RunConfig's sections: field name -> dataclass (its annotations are strings, resolved here once)."""
    hints = typing.get_type_hints(RunConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig)}


@functools.cache  # a command asks several times (parsing, validating, building the config): built once
def _run_fields() -> tuple[tuple[str, dataclasses.Field, Flag], ...]:
    return tuple((name, f, dataclasses.replace(f.metadata["flag"], panel=PANELS[name]))
                 for name, kind in _sections().items() for f in dataclasses.fields(kind))


def check(flag: Flag, value: Any) -> None:
    """One option's value against its rules; AdaptiveError naming the flag, the rule and the value."""
    if value is None or isinstance(value, bool):
        return
    if flag.choices is not None and flag.many:
        for item in str(value).split(","):
            if item.strip() not in flag.choices:
                near = closest(item.strip(), flag.choices)
                raise AdaptiveError(f"{flag.name} takes a comma-separated list of {', '.join(flag.choices)}, got "
                                    f"{item.strip()!r}" + (f"; did you mean {near}?" if near else ""))
        return
    if flag.pattern is not None and isinstance(value, str) and not re.fullmatch(flag.pattern[0], value):
        raise AdaptiveError(f"{flag.name} takes {flag.pattern[1]}, got {value!r}")
    if flag.choices is not None and value not in flag.choices:
        raise AdaptiveError(f"{flag.name} must be one of {', '.join(flag.choices)}, got {value!r}")
    if not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise AdaptiveError(f"{flag.name} must be a finite number, got {value}")
    positive = flag.above == 0 or (flag.minimum == 1 and isinstance(value, int))
    if flag.minimum is not None and value < flag.minimum:
        rule = "positive" if positive else f">= {flag.minimum:g}"
        raise AdaptiveError(f"{flag.name} must be {rule}, got {value:g}")
    if flag.above is not None and value <= flag.above:
        rule = "positive" if positive else f"> {flag.above:g}"
        raise AdaptiveError(f"{flag.name} must be {rule}, got {value:g}")
    if flag.maximum == 1.0 and 1 < value <= 100:  # a percent where a fraction goes
        raise AdaptiveError(f"{flag.name} {value:g} is not a fraction: did you mean {value / 100:g}?")
    if flag.maximum is not None and value > flag.maximum:
        raise AdaptiveError(f"{flag.name} must be <= {flag.maximum:g}, got {value:g}")


# The suffixes a number may carry (Flag.unit). Counts of tokens and parameters are decimal, as papers write them;
# memory is in GiB (2^30 bytes, as `nvidia-smi` and the planner's *_bytes / 2^30 figures), and takes decimal GB/TB
# (1e9, 1e12 bytes: datasheets' and clouds' "256 GB") or binary MiB/GiB/TiB.
UNITS: dict[str, tuple[dict[str, float], str, str]] = {  # unit -> (suffix -> multiplier, what it takes, example)
    "count": ({"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12},
              "a count: a number or one with K, M, B or T (1e3, 1e6, 1e9, 1e12)", "20B"),
    "gib": ({"MB": 1e6 / 2**30, "GB": 1e9 / 2**30, "TB": 1e12 / 2**30, "MiB": 2**-10, "GiB": 1, "TiB": 2**10},
            "GiB: a number or one with GB, TB (1e9, 1e12 bytes), MiB, GiB or TiB", "256GiB"),
}
# nan and inf parse, for check() to say they are not finite
_QUANTITY = re.compile(r"\s*([+-]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|(?i:nan|inf)))\s*([A-Za-z]*)\s*")


def quantity(flag: Flag, text: str, integer: bool = False) -> float | int:
    """`text` ("20B", "1.5T", "256GB", "2e9") as the number `flag` takes; AdaptiveError naming the nearest valid one."""
    assert flag.unit in UNITS, flag
    multipliers, takes, example = UNITS[flag.unit]
    m = _QUANTITY.fullmatch(text)
    if m is None:
        raise AdaptiveError(f"{flag.name} {text!r} is not {takes}; e.g. {example}")
    number, suffix = m.groups()
    by_lower = {k.lower(): v for k, v in multipliers.items()} | {"": 1.0}  # a plain number is in the flag's unit
    if suffix.lower() not in by_lower:
        near = closest(suffix, multipliers)
        hint = f"did you mean {number}{near}?" if near else f"e.g. {example}"
        raise AdaptiveError(f"{flag.name} {text!r}: unknown unit {suffix!r}, it takes {takes}; {hint}")
    value = float(number) * by_lower[suffix.lower()]
    if integer:
        if value != int(value):
            raise AdaptiveError(f"{flag.name} {text!r} is not a whole number; did you mean {round(value)}?")
        return int(value)
    return value


def options_for(command: str) -> list[tuple[str, dataclasses.Field, Flag]]:
    return [(s, f, flag) for s, f, flag in run_fields() if command in flag.commands]


def to_argv(config: RunConfig, command: str = TRAIN) -> list[str]:
    """The flags that give `config`'s non-default values to `command` (how launch hands a run to its recipe)."""
    argv: list[str] = []
    for section, f, flag in options_for(command):
        value = getattr(getattr(config, section), f.name)
        if value == f.default:
            continue
        if isinstance(value, bool):
            argv.append(flag.name if value else flag.negative)
        else:
            argv += [flag.name, repr(value) if isinstance(value, float) else str(value)]
    return argv


__all__ = ["COMPARE", "ESTIMATE", "FIT", "FIT_ONLY", "Flag", "LAUNCH", "LAUNCH_ONLY", "MEASURE", "PLANNING", "RUN", "RunConfig",
           "SCALE", "SHAPE", "SWEEP", "TRAIN", "UNITS", "WORLD", "check", "option", "options_for", "quantity", "run_fields",
           "to_argv"]
