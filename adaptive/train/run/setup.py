"""Build what the loop runs: the process group, the Accelerator with its DeepSpeed plugin, the
tokenizer and data, the model, the optimizer and the LR schedule.

Every run goes through DeepSpeed via accelerate, whoever launched it (accelerate launch, torchrun,
deepspeed, or plain `python recipes/x.py` for one process). The DeepSpeed config comes from
`runplan.plan_run` and is handed to `DeepSpeedPlugin(hf_ds_config=...)`; accelerate fills the
hidden-size "auto" values.
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.logging import get_logger

from adaptive.config.run import DataOptions
from adaptive.engine import moe_param_groups
from adaptive.plan.architecture.blocks import block_type
from adaptive.plan.architecture.presets import PRESETS
from adaptive.train.run.callbacks import Knobs
from adaptive.train.run.runplan import RunPlan
from adaptive.train.run.sequence_parallel import ATTENTION as SP_ATTENTION, parallelism_config

ADAM_BETAS = (0.9, 0.95)  # GPT-3's and Llama 2's betas (docs/BENCHMARKS.md, "Claims we compared against")
ADAM_EPS = 1e-8
# Peak learning rates by preset: GPT-3 (Brown et al. 2020, table 2.1) uses 6e-4 at 125M-350M and
# 2e-4-3e-4 at 1-7B; Llama 2 7B 3e-4. The debug model is tiny and trains for a few steps.
DEFAULT_LR = {"debug": 3e-3, "debug_200m": 6e-4, "b1": 3e-4, "b7": 3e-4}
FALLBACK_LR = 3e-4
WEIGHT_DECAY = 0.1
DATA_WORKERS_GPU = 2  # streamed data: loader processes per GPU; one keeps ~7x ahead of b1 on an H100 (docs/BENCHMARKS.md)

logger = get_logger(__name__)


def ensure_process_group_env() -> None:
    """Without a launcher, make this process a world of one so DeepSpeed can initialise."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        os.environ.setdefault("LOCAL_RANK", "0")
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))


def init_distributed(collective_timeout: float | None = None) -> Any:
    """accelerate's PartialState on DeepSpeed's process group (nccl on GPUs, gloo on a CPU). `collective_timeout`
    (--collective-timeout, seconds): how long a collective waits for the other ranks. PartialState hands its
    keyword arguments to deepspeed.comm.init_distributed (accelerate/state.py, PartialState.__init__), whose
    `timeout` goes to torch's init_process_group (deepspeed/comm/torch.py, TorchBackend.init_process_group);
    DeepSpeed's own default is 10 minutes (deepspeed/constants.py default_pg_timeout), NCCL's 30."""
    from datetime import timedelta

    from accelerate import PartialState

    from adaptive.engine import compile_ops, pin_ninja, prints_held, shm_comm_op_built_line

    pin_ninja()
    ensure_process_group_env()
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    # DeepSpeed's ZeRO gathers and ZeRO-3's gradient reduce-scatter (deepspeed/comm/torch.py) call them, deprecated
    # in torch 2.13: not the user's to fix
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                            "is deprecated", category=FutureWarning)
    timeout = {} if collective_timeout is None else {"timeout": timedelta(seconds=collective_timeout)}
    restart_scoped_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout.get("timeout"))
    if torch.cuda.is_available():
        return PartialState(**timeout)
    # compiled here, said first, where DeepSpeed's process-group init would compile it silently
    say = announce if os.environ["RANK"] == "0" else None
    compile_ops(["ShareMemCommBuilder"], say)
    # DeepSpeed prints that it built the op when it only loaded the compiled one
    with prints_held(shm_comm_op_built_line):
        # Without CUDA, accelerate picks no backend for DeepSpeed and then counts one process per rank;
        # naming gloo makes it read the world from the process group DeepSpeed initialises.
        return PartialState(backend="gloo", **timeout)


def announce(line: str) -> None:
    """A one-off notice of the run's progress (a DeepSpeed op compiling), on stdout: stderr keeps the run's log, and
    a run that stops on bad input says only why, in one line."""
    print(line, flush=True)


def restart_scoped_process_group(backend: str, timeout: Any) -> None:
    """On a restarted worker (TORCHELASTIC_RESTART_COUNT > 0), create the default process group over keys of
    this attempt alone; DeepSpeed and accelerate then wrap it (deepspeed/comm/torch.py creates a group only
    when none exists). torchrun's agent keeps one store across restarts and torch keys the group's
    rendezvous by its name only, so a restarted gloo rank can read the dead attempt's addresses and fail to
    connect (measured: `Gloo connectFullMesh failed ... Connection refused`, plain torch and DeepSpeed alike)."""
    from adaptive.train.run.restart import restart_count

    attempt = restart_count({"TORCHELASTIC_RESTART_COUNT": os.environ.get("TORCHELASTIC_RESTART_COUNT", "")})
    if attempt == 0 or torch.distributed.is_initialized():
        return
    import torch.distributed as dist

    extra = {} if timeout is None else {"timeout": timeout}
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store, rank, world_size = next(dist.rendezvous("env://", rank, world_size, **extra))  # the agent's store
    dist.init_process_group(backend, store=dist.PrefixStore(f"adaptive/restart_{attempt}", store), rank=rank,
                            world_size=world_size, **extra)


def make_accelerator(run: RunPlan, trackers: list[str] | None = None, output_dir: Path | None = None) -> Any:
    """An Accelerator on DeepSpeed with the run's config. The loop steps the LR schedule itself, once
    per optimizer step (accelerate would step it once per process). `trackers` (--report-to, resolved) log
    under `output_dir`/trackers/ (adaptive.train.reporting.trackers)."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, ProjectConfiguration

    from adaptive.train.reporting.trackers import logging_dir

    # accelerate refuses a DeepSpeed config next to DeepSpeed fields of an accelerate config file;
    # plan_run has folded those fields into the config, so the check has nothing left to protect.
    os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
    plugin = DeepSpeedPlugin(hf_ds_config=copy.deepcopy(run.ds_config),
                             zero3_init_flag=run.knobs.zero_stage == 3)
    mixed = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[run.precision]
    project = {} if output_dir is None else {"project_config": ProjectConfiguration(
        project_dir=str(output_dir), logging_dir=str(logging_dir(output_dir)))}
    # Ulysses: accelerate's prepare registers DeepSpeed's attention and passes its SP groups (sequence_parallel.py)
    sequence = parallelism_config(run.knobs.sp_size, run.world.size)
    return Accelerator(deepspeed_plugin=plugin, mixed_precision=mixed,
                       gradient_accumulation_steps=run.ds_config["gradient_accumulation_steps"],
                       step_scheduler_with_optimizer=False, log_with=trackers or None,
                       **({"parallelism_config": sequence} if sequence is not None else {}), **project)


def quiet_libraries(is_main: bool) -> None:
    """DeepSpeed and datasets talk a lot; keep their INFO lines and progress bars off."""
    import datasets
    import transformers
    from deepspeed.utils import logger as ds_logger

    from adaptive.train.reporting.display import interactive

    ds_logger.setLevel(logging.WARNING)
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its save/load chatter; ours says it once
    # bitsandbytes' CPU path tries a hub kernel first and falls back to its own: offline, a warning per run
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # ... and its `kernels` look-up says, offline, that it skipped the hub's publisher check (transformers' LR
    # schedules import PEFT, which imports bitsandbytes, in every run)
    logging.getLogger("kernels").setLevel(logging.ERROR)
    # PEFT 0.21 (peft_model.py) calls transformers' deprecated `is_gradient_checkpointing`: not the user's to fix
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    # PEFT 0.21 doubles rank and alpha on a MoE's fused expert parameters (target_parameters) through rank_pattern
    # and alpha_pattern, then checks those keys against the targeted *modules* only and calls them unmatched: a
    # false alarm on every Mixtral or Qwen3-MoE LoRA (the trainable count is PEFT's own, tests/fidelity)
    warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match any targeted module",
                            category=RuntimeWarning)
    transformers.logging.set_verbosity_warning()
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars: the run logs what it loaded
    if not is_main or not interactive():
        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()


@dataclass
class Data:
    tokenizer: Any
    train: Any
    eval: Any


def load_data(options: DataOptions, seed: int, run: RunPlan, accelerator: Any, model_vocab_size: int) -> Data:
    """Tokenizer and this rank's train/eval data (rank 0 fills the caches first)."""
    from adaptive.train.data.packing import StreamingPackedDataset, build_datasets
    from adaptive.train.data.sources import DataConfig
    from adaptive.train.data.tokenizer import load_tokenizer, require_fits_vocab

    dataset = resolve_dataset(options.dataset, run.device.kind)
    cuda = run.device.kind == "cuda"
    workers = options.data_workers if options.data_workers is not None else (DATA_WORKERS_GPU if cuda else 1)
    cfg = DataConfig(dataset=dataset, seq_len=run.knobs.seq_len, seed=seed, dataset_config=options.dataset_config,
                     text_field=options.text_field, workers=workers, pin_memory=cuda, packing=options.packing)
    with accelerator.main_process_first():
        tokenizer = load_tokenizer(tokenizer_source(options, run.init_from))
        require_fits_vocab(tokenizer, model_vocab_size)
        # a TP group (consecutive ranks, DeepSpeed's TP mesh) trains on one copy of the data; so do a pipeline's
        # stages and their TP ranks (ranks (stage x replicas + replica) x tp + tp rank, DeepSpeed's
        # PipeModelDataParallelTopology; PipeDataParallelTopology is its tp 1)
        tp, pp = run.knobs.tp_size, run.knobs.pp_size
        replicas = accelerator.num_processes // (tp * pp)
        rank = (accelerator.process_index // tp) % replicas
        train, evaluation = build_datasets(cfg, tokenizer, rank=rank, world_size=replicas)
    if options.data_workers and not isinstance(train, StreamingPackedDataset):
        logger.warning("--data-workers %d ignored: %s is tokenized once up front (map-style), not streamed",
                       options.data_workers, dataset or "the shipped corpus")
    return Data(tokenizer, train, evaluation)


def tokenizer_source(options: DataOptions, init_from: str | None) -> str | None:
    """--tokenizer, else the --init-from checkpoint's own (when its folder has one), else None: the built-in one."""
    from adaptive.train.run_folder.init_from import tokenizer_folder

    return options.tokenizer or tokenizer_folder(init_from)


def resolve_dataset(flag: str | None, device_kind: str) -> str | None:
    """--dataset; by default C4 (streamed) on GPUs with the hub reachable, else the shipped corpus."""
    if flag == "builtin":
        return None
    if flag is not None:
        return flag
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or \
        os.environ.get("HF_DATASETS_OFFLINE", "0") not in ("", "0")
    return "c4" if device_kind == "cuda" and not offline else None


def build_model(run: RunPlan, tokenizer: Any, seed: int, device: Any = None) -> Any:
    """The preset (or --init-from's checkpoint, weights loaded) as `arch`, DeepSpeed MoE (with the plan's ep_size)
    for MoE layers; under --pp-size this rank's pipeline stage of it. A fine-tune of a transformers family: that
    family's own class with the method applied (adaptive/models/finetune.py)."""
    from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM
    from adaptive.train.run_folder.init_from import load_init_weights, target_config

    knobs = run.knobs
    if run.transformers_class:
        from adaptive.models.finetune import apply_method, load_pretrained

        request = run.plan.request
        model = load_pretrained(run.init_from, run.finetune, run.precision, knobs.zero_stage, request.attention,
                                device if device is not None else torch.device("cpu"))
        return apply_method(model, request.spec, run.finetune, knobs.checkpoint_policy)
    settings = dict(moe_implementation="deepspeed" if block_type(run.arch).has_experts else "native",
                    ep_size=knobs.ep_size, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id)
    if run.init_from:
        config = target_config(run.init_from, run.plan.request.spec, **settings)
    elif run.preset in PRESETS:
        config = AdaptiveConfig.from_preset(run.preset, arch=run.arch, **settings)
    else:  # a config.json's shape (--model PATH), as the planner read it
        config = AdaptiveConfig.from_spec(run.plan.request.spec, **settings)
    # under ZeRO-3: deepspeed.zero.Init; under Ulysses, the attention its registration expects
    attention = {"attn_implementation": SP_ATTENTION} if knobs.sp_size > 1 else {}
    model = AdaptiveForCausalLM._from_config(config, dtype=torch.float32, **attention)
    if knobs.pp_size > 1 and knobs.ep_size > 1 and config.moe_layers:  # expert groups inside each stage's ranks
        from adaptive.engine import use_pipeline_grid
        from adaptive.models.moe_deepspeed import ensure_distributed

        ensure_distributed()
        use_pipeline_grid(knobs.pp_size)
    if run.init_from:
        load_init_weights(model, run.init_from)
    elif knobs.ep_size > 1 and config.moe_layers:
        reinit_local_experts(model, seed, knobs.tp_size)
    if knobs.pp_size > 1:  # this rank's stage, with the same weights (adaptive/models/pipeline.py)
        from adaptive.models.pipeline import to_pipeline

        return to_pipeline(model, knobs.pp_size, run.pp_partition, knobs.checkpoint_policy, knobs.tp_size)
    if knobs.checkpoint_policy != "off":  # full, or selective (mlp, every:N) as planned or pinned
        from adaptive.models.checkpointing import apply_checkpointing

        apply_checkpointing(model, knobs.checkpoint_policy)
    return model


def reinit_local_experts(model: Any, seed: int, tp_size: int = 1) -> None:
    """Under expert parallelism every rank builds its local experts from the same seed, so global
    experts r*E/P + i would start equal on every rank r; draw each rank's experts afresh instead. The ranks
    of a TP group share an expert-parallel rank, so they draw the same whole experts, which AutoTP shards."""
    from adaptive.models.moe_deepspeed import DeepSpeedMoE, expert_parallel_rank

    blocks = [m for m in model.modules() if isinstance(m, DeepSpeedMoE)]
    model.setup_expert_parallel(tp_size)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + 1 + expert_parallel_rank(blocks[0].ep_size))
    std = model.config.initializer_range
    with torch.no_grad():
        for block in blocks:
            for module in block.deepspeed_moe.experts.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                    if module.bias is not None:
                        module.bias.zero_()


def param_groups(model: Any, weight_decay: float) -> list[dict]:
    """Decay on matrices, none on norms and biases; MoE experts in their own groups (DeepSpeed's
    adaptive.engine.moe_param_groups), as ZeRO with expert parallelism needs."""
    def matrix(p) -> bool:  # under ZeRO-3 init a parameter is a flat partition; ds_shape is its real shape
        return len(getattr(p, "ds_shape", p.shape)) >= 2

    decay = [p for p in model.parameters() if p.requires_grad and matrix(p)]
    no_decay = [p for p in model.parameters() if p.requires_grad and not matrix(p)]
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    # transformers' classes (a fine-tune) have no DeepSpeed MoE layers
    if getattr(model.config, "moe_layers", None) and model.config.moe_implementation == "deepspeed":
        groups = moe_param_groups(groups)
    return [g for g in groups if g["params"]]


def build_optimizer(model: Any, knobs: Knobs, lr: float, weight_decay: float, optimizer: str = "auto") -> Any:
    """AdamW(0.9, 0.95, eps 1e-8) as `--optimizer` names it (plan/estimate/optimizers.py): torch's (auto, foreach or
    fused), bitsandbytes' 8-bit ones (adamw_8bit, paged_adamw_8bit: a client optimizer DeepSpeed runs under ZeRO),
    DeepSpeed's FusedAdam, or DeepSpeed's CPU Adam when the optimizer is offloaded (auto under offload)."""
    groups = param_groups(model, weight_decay)
    kwargs = dict(lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=weight_decay)
    if optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        import bitsandbytes as bnb

        kind = bnb.optim.PagedAdamW8bit if optimizer == "paged_adamw_8bit" else bnb.optim.AdamW8bit
        return kind(groups, **kwargs)
    if knobs.offload_optimizer and optimizer in ("auto", "deepspeed_cpu_adam"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    if optimizer == "deepspeed_fused_adam":
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, adam_w_mode=True, **kwargs)
    flavour = {"adamw_torch": {"foreach": True}, "adamw_torch_fused": {"fused": True}}.get(optimizer, {})
    return torch.optim.AdamW(groups, **kwargs, **flavour)


def build_scheduler(optimizer: Any, warmup_steps: int, max_steps: int) -> Any:
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=warmup_steps, num_training_steps=max_steps)


def default_warmup(max_steps: int) -> int:
    """5% of the run, at most 2000 steps."""
    return max(1, min(2000, round(0.05 * max_steps)))


def peak_lr(lr: float | None, preset: str) -> float:
    """--lr (the run configuration checked it is positive and finite), else the preset's default."""
    return lr if lr is not None else DEFAULT_LR.get(preset, FALLBACK_LR)


__all__ = ["ADAM_BETAS", "ADAM_EPS", "DEFAULT_LR", "Data", "build_model", "build_optimizer", "build_scheduler",
           "default_warmup", "ensure_process_group_env", "init_distributed", "load_data", "make_accelerator",
           "restart_scoped_process_group",
           "announce", "param_groups", "peak_lr", "quiet_libraries", "reinit_local_experts", "resolve_dataset",
           "tokenizer_source"]
