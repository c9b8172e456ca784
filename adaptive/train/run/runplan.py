"""Size a training run: which device, which GPU, which knobs and which DeepSpeed config.

Runs before anything heavy (no Accelerator, no model); imports torch only to detect a CUDA GPU when
`--gpu` is not given. The same `adaptive.plan.fit` as `adaptive fit` chooses the knobs.

Where the DeepSpeed config comes from (first match wins):

    "file"          --ds-config FILE
    "accelerate"    an accelerate config (or launch flags) naming DeepSpeed settings: its
                    deepspeed_config_file (ACCELERATE_DEEPSPEED_CONFIG_FILE), or its zero_stage /
                    offload / gradient_accumulation_steps / gradient_clipping
    "plan"          otherwise: emitted from the plan (`adaptive.plan.ds_config.emit.ds_config`)

A file's explicit values pin the planner (ZeRO stage, offload, micro-batch, accumulation); its
"auto" values are filled from the plan. accelerate's own settings pin the planner the same way.
A flag that contradicts an explicit value is an error.

On a machine without CUDA the run goes to the CPU: fp32, and small knobs from flags or CPU
defaults (sequence 128, micro-batch 4, accumulation 1, no offload, ep_size 1). The planner still
runs, with those knobs pinned, against `--gpu` or a nominal a100-80gb; on a CPU only its model
FLOPs per token and its ZeRO layout are used, its GPU memory and speed figures are not.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, replace
from typing import Any

from adaptive.config.run import RunConfig
from adaptive.errors import AdaptiveError, from_validation
from adaptive.extras import require
from adaptive.train.run.callbacks import Knobs
from adaptive.train.run_folder.init_from import planned_model
from adaptive.plan import GPU, Plan, fit, get_gpu, make_request
from adaptive.plan.ds_config.reader import ZERO_QUANTIZE, load as load_ds_file, offload_pin, pins as file_pins
from adaptive.plan.ds_config.emit import GRADIENT_CLIPPING, ds_config
from adaptive.plan.hardware.gpus import match_detected_gpu

NOMINAL_GPU = "a100-80gb"  # what a CPU run is planned against when --gpu is not given
CPU_SEQ_LEN = 128
CPU_MICRO_BATCH = 4
CPU_GRAD_ACCUM = 1
CPU_MAX_STEPS = 100
GPU_SEQ_LEN = 2048  # the regime of the claims we compared against (docs/BENCHMARKS.md)
FP16_SECTION = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                "hysteresis": 2, "min_loss_scale": 1}


def _data_parallel_ranks(world_size: int, sp_size: int, tp_size: int, pp_size: int = 1) -> int:
    """The data-parallel ranks DeepSpeed counts: processes / (sp x tp x pp)."""
    return world_size // (sp_size * tp_size * pp_size)


@dataclass(frozen=True)
class World:
    """Processes of the launch: all of them, per node, and nodes."""

    size: int = 1
    per_node: int = 1

    @property
    def nodes(self) -> int:
        return max(1, self.size // self.per_node)


def launcher_world() -> World:
    """The world the launcher (accelerate, torchrun, deepspeed) set up; one process without one."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or size)
    return World(size, min(per_node, size))


@dataclass(frozen=True)
class Device:
    kind: str  # "cuda" | "cpu"
    gpu: GPU | None  # the catalog GPU the run is measured against; None on a CPU
    detected: str | None = None  # what torch reported


def detect_device(gpu_flag: str | None, assume_gpu: bool = False) -> Device:
    """CUDA with its catalog GPU, or the CPU. `--gpu` names the GPU; with `assume_gpu` (dry runs)
    it is taken as present without looking."""
    named = get_gpu(gpu_flag) if gpu_flag else None
    if named is not None and assume_gpu:
        return Device("cuda", named)
    require("finding the GPU (no --gpu given)")
    import torch

    if not torch.cuda.is_available():
        return Device("cpu", None)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    detected = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    if named is not None:
        return Device("cuda", named, detected)
    match = match_detected_gpu(props.name, props.total_memory)
    if match is None:
        raise AdaptiveError(f"GPU {detected} is not in the catalog; pass --gpu NAME (see `adaptive gpus`)")
    return Device("cuda", match, detected)


@dataclass(frozen=True)
class DeepSpeedSource:
    kind: str  # "file" | "accelerate" | "plan"
    path: str | None = None
    config: dict[str, Any] | None = None  # the file's config, "auto" values still in it
    pins: dict[str, Any] | None = None  # knobs it fixes: zero, offload, micro_batch, grad_accum, clipping


def _explicit(value: Any) -> bool:
    return value is not None and value != "auto"


def accelerate_pins(env: dict[str, str]) -> dict[str, Any]:
    """DeepSpeed settings an accelerate config or launch flags set (ACCELERATE_* variables)."""
    pins: dict[str, Any] = {}
    if "ACCELERATE_DEEPSPEED_ZERO_STAGE" in env:
        pins["zero"] = int(env["ACCELERATE_DEEPSPEED_ZERO_STAGE"])
    offload = offload_pin(env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
                           env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"))
    if offload is not None:
        pins["offload"] = offload
    gas = env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "")
    if gas.isdigit():
        pins["grad_accum"] = int(gas)
    clip = env.get("ACCELERATE_GRADIENT_CLIPPING", "")
    if clip and clip != "auto":
        pins["clipping"] = float(clip)
    return pins


def deepspeed_source(ds_config_flag: str | None, env: dict[str, str] | None = None) -> DeepSpeedSource:
    env = dict(os.environ) if env is None else env
    if ds_config_flag:
        cfg = load_ds_file(ds_config_flag)
        return DeepSpeedSource("file", ds_config_flag, cfg, file_pins(cfg))
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if path and path != "none":
            cfg = load_ds_file(path, "accelerate's deepspeed_config_file")
            return DeepSpeedSource("accelerate", path, cfg, file_pins(cfg))
        pins = accelerate_pins(env)
        if pins:
            return DeepSpeedSource("accelerate", None, None, pins)
    return DeepSpeedSource("plan")


def precision_for(device: Device, source: DeepSpeedSource, env: dict[str, str]) -> str:
    """bf16 where the GPU has it, fp16 with loss scaling where not (T4), fp32 on a CPU; an explicit
    choice in the DeepSpeed file or accelerate's --mixed_precision wins."""
    chosen = (source.pins or {}).get("precision")
    launched = env.get("ACCELERATE_MIXED_PRECISION", "no")
    if launched in ("bf16", "fp16"):
        if chosen is not None and chosen != launched:
            raise AdaptiveError(f"accelerate's --mixed_precision {launched} contradicts {chosen} in {source.path}")
        chosen = launched
    if device.kind == "cpu":
        if chosen == "fp16":
            raise AdaptiveError("fp16 needs a GPU; on a CPU train in fp32 (or bf16 in the DeepSpeed config)")
        return chosen or "fp32"
    if chosen == "bf16" and not device.gpu.bf16:
        raise AdaptiveError(f"{device.gpu.name} has no bf16; use fp16 (loss scaling) or omit the precision")
    return chosen or ("bf16" if device.gpu.bf16 else "fp16")


@dataclass(frozen=True)
class RunPlan:
    """Everything the run is sized with."""

    preset: str
    arch: str
    plan: Plan
    knobs: Knobs
    ds_config: dict[str, Any]  # what goes to accelerate's DeepSpeedPlugin (hidden-size "auto"s remain)
    ds_source: DeepSpeedSource
    precision: str  # "bf16" | "fp16" | "fp32"
    device: Device
    world: World
    max_steps: int
    orchestrator_requested: str
    orchestrator: bool
    init_from: str | None = None  # the checkpoint folder the weights start from (its config.json is the shape)
    pp_partition: str = "parameters"  # --pp-partition: DeepSpeed's partition_method under --pp-size
    epochs: float | None = None  # passes over the data (a fine-tune's default: 1); max_steps then follows the data

    @property
    def finetune(self) -> Any:
        """The fine-tuning method (plan/finetune/method.py), None for pretraining."""
        return self.plan.request.finetune

    @property
    def transformers_class(self) -> bool:
        """A fine-tune of a transformers family trains transformers' own class (adaptive/models/finetune.py)."""
        return self.finetune is not None and self.plan.request.spec.model_type != "adaptive"

    def with_epochs(self, samples_per_epoch: int) -> RunPlan:
        """max_steps for `epochs` passes over `samples_per_epoch` samples (over every data-parallel replica)."""
        if self.epochs is None:
            return self
        replicas = _data_parallel_ranks(self.world.size, 1, self.knobs.tp_size, self.knobs.pp_size)
        per_step = self.knobs.samples_per_step * replicas
        return replace(self, max_steps=max(1, math.ceil(self.epochs * samples_per_epoch / per_step)))

    @property
    def tokens_per_step(self) -> int:
        return self.knobs.tokens_per_step * _data_parallel_ranks(self.world.size, 1, self.knobs.tp_size,
                                                                 self.knobs.pp_size)

    @property
    def peak_tflops(self) -> float | None:
        """The GPU's peak for MFU; None on a CPU."""
        return self.device.gpu.peak_tflops if self.device.kind == "cuda" and self.device.gpu else None

    @property
    def model_flops_per_token(self) -> float:
        return self.plan.shown.throughput.model_flops_per_token

    def flops_per_token_at(self, seq_len: int) -> float:
        """Model FLOPs per token at `seq_len` (attention spans the sequence, so a shorter one costs less)."""
        if seq_len == self.plan.shown.setup.seq_len:
            return self.model_flops_per_token
        from adaptive.plan.estimate.throughput import model_flops_per_token

        return model_flops_per_token(self.plan.shown.setup.spec, seq_len)

    def summary(self) -> dict[str, Any]:
        """The run section written to plan.json and printed by --dry-run."""
        return {
            "preset": self.preset,
            "arch": self.arch,
            "device": self.device.kind,
            "gpu": self.device.gpu.name if self.device.gpu else None,
            "detected": self.device.detected,
            "planned_against": self.plan.request.gpu.name,
            "world_size": self.world.size,
            "gpus_per_node": self.world.per_node,
            "num_nodes": self.world.nodes,
            "precision": self.precision,
            "knobs": self.knobs.as_dict(),
            "ds_config_source": {"kind": self.ds_source.kind, "path": self.ds_source.path},
            "max_steps": self.max_steps,
            "epochs": self.epochs,
            "finetune": self.finetune.method if self.finetune else None,
            "init_from": self.init_from,
            "tokens_per_step": self.tokens_per_step,
            "model_flops_per_token": self.model_flops_per_token,
            "orchestrator": {"requested": self.orchestrator_requested, "enabled": self.orchestrator,
                             "reason": self.plan.orchestrator.reason},
        }


def _merge_pin(name: str, flag: Any, pinned: Any, source: DeepSpeedSource) -> Any:
    if flag is not None and pinned is not None and flag != pinned:
        where = source.path or "the accelerate config"
        raise AdaptiveError(f"--{name.replace('_', '-')} {flag} contradicts {pinned} in {where}")
    return flag if flag is not None else pinned


def plan_run(config: RunConfig, preset: str, arch: str, world: World, device: Device,
             env: dict[str, str] | None = None) -> RunPlan:
    """Plan the run of `preset` as `arch` with `config`'s options on `world` x `device`."""
    env = dict(os.environ) if env is None else env
    par = config.parallelism
    source = deepspeed_source(par.ds_config, env)
    pins = source.pins or {}
    cpu = device.kind == "cpu"
    zero = _merge_pin("zero", par.zero, pins.get("zero"), source)
    offload = _merge_pin("offload", par.offload, pins.get("offload"), source)
    micro = _merge_pin("micro_batch", par.micro_batch, pins.get("micro_batch"), source)
    accum = _merge_pin("grad_accum", par.grad_accum, pins.get("grad_accum"), source)
    seq = config.data.seq_len or (CPU_SEQ_LEN if cpu else GPU_SEQ_LEN)
    checkpointing, ep_size = config.checkpointing.gradient_checkpointing, par.ep_size
    policy = config.checkpointing.checkpoint_policy  # off | full | selective | mlp | every:N (planner.py)
    global_tokens = None
    layout = layout_pins(par, source)
    pinned_sp, pinned_tp = layout["sp_size"] or 1, layout["tp_size"] or 1
    pp = layout["pp_size"] or 1
    if pp > 1:
        zero = pipeline_zero(pp, zero, pinned_sp, pinned_tp, ep_size, arch, world)
    # --grad-accum is DeepSpeed's gradient_accumulation_steps: a replica's micro-steps per optimizer step. Under
    # SP, DeepSpeed's Ulysses data adapter makes each rank's micro-batch one of its group's micro-steps, so each
    # rank loads accum / sp micro-batches (the loop's accumulation).
    if cpu:
        micro = micro or CPU_MICRO_BATCH
        accum = accum or CPU_GRAD_ACCUM * pinned_sp
        offload = offload or "none"
        checkpointing = bool(checkpointing) if policy is None else checkpointing
        ep_size = ep_size or 1
        # over the replicas; under --pp-size the planner derives it from the pinned batch knobs and its pp_size
        global_tokens = micro * accum * seq * world.size // (pinned_tp * pinned_sp) if pp == 1 else None
    if accum and accum % pinned_sp:
        raise AdaptiveError(f"--grad-accum ({accum}) must be a multiple of --sp-size ({pinned_sp}): DeepSpeed's "
                            "Ulysses data adapter runs each rank's micro-batch as one of its group's micro-steps")
    gpu = config.hardware.gpu
    tokens, max_steps = config.schedule.tokens, config.schedule.max_steps
    if tokens is not None and max_steps is not None:
        raise AdaptiveError("give --max-steps or --tokens, not both")
    ft = config.finetune
    if ft.finetune and not config.model.init_from:
        raise AdaptiveError(f"--finetune {ft.finetune} fine-tunes a checkpoint: give --init-from PATH, a folder with "
                            "its config.json and weights (and tokenizer)")
    if ft.epochs is not None and (tokens is not None or max_steps is not None):
        raise AdaptiveError("give --epochs, --max-steps or --tokens, not two of them")
    request = make_request(
        model=planned_model(config.model.init_from, preset, arch, finetune=ft.finetune),
        # a fine-tune trains the checkpoint's own arch with its own class (transformers' for their families);
        # otherwise what recipes train: our classes with their lean kernels
        arch=None if ft.finetune else arch, kernels=None if ft.finetune else "lean",
        gpu=device.gpu.name if device.gpu else (gpu or NOMINAL_GPU),
        gpus=world.per_node, nodes=world.nodes, seq_len=seq, global_batch_tokens=global_tokens,
        tokens=tokens, zero=zero, offload=offload, micro_batch=micro, grad_accum=accum,
        checkpointing=checkpointing, ep_size=ep_size, checkpoint_policy=policy,
        sp_size=layout.get("sp_size"), tp_size=layout.get("tp_size"), zero_hpz=layout.get("zero_hpz"),
        zero_quantize=layout.get("zero_quantize"), pp_size=layout["pp_size"], optimizer=config.optimizer.optimizer,
        finetune=ft.finetune, lora_rank=ft.lora_rank, lora_alpha=ft.lora_alpha, lora_targets=ft.lora_targets,
        lora_dropout=ft.lora_dropout, epochs=ft.epochs, nvme_path=par.nvme_path, nvme_gbps=par.nvme_gbps,
    )
    # fit refuses, in one line, a layout DeepSpeed or this runtime cannot train (plan/estimate/parallel.py layout_error)
    plan = fit(request, suggest=not cpu)
    if not plan.fits and not cpu:
        hint = f"; would fit: {plan.suggestions[0]}" if plan.suggestions else ""
        raise AdaptiveError(
            f"{preset} {arch} does not fit {world.size} x {request.gpu.name} with these settings"
            f"{hint} (see `adaptive fit --model {preset} --arch {arch} --gpu {request.gpu.name}`)"
        )
    chosen = plan.shown
    s = chosen.setup
    sp_size, tp_size = s.sp_size, s.tp_size  # the pins, or the plan's choice
    if chosen.grad_accum % sp_size:
        raise AdaptiveError(f"the plan's gradient accumulation ({chosen.grad_accum}) must be a multiple of sp_size "
                            f"({sp_size}); pin --grad-accum to one")
    knobs = Knobs(micro_batch_size=s.micro_batch_size, gradient_accumulation_steps=chosen.grad_accum // sp_size,
                  seq_len=s.seq_len, gradient_checkpointing=s.gradient_checkpointing, zero_stage=s.zero_stage,
                  offload_optimizer=s.offload_optimizer, offload_params=s.offload_params, ep_size=s.ep_size,
                  checkpoint_policy=s.checkpointing,
                  sp_size=sp_size, tp_size=tp_size, pp_size=pp)
    precision = precision_for(device, source, env)
    base = source.config if source.config is not None else ds_config(s, chosen.grad_accum, request.gpu,
                                                                      request.nvme_path)
    cfg = finalize_ds_config(base, knobs, world.size, precision, pins.get("clipping"), zero_plus(layout))
    quantized = [k for k in ("zero_quantized_weights", "zero_quantized_gradients") if cfg["zero_optimization"].get(k)]
    if cpu and quantized:
        # qwZ fails building the model (zero/partition_parameters.py, CUDAQuantizer), qgZ in the first backward
        # (comm/coalesced_collectives.py): DeepSpeed's CPU op builder has no QuantizerBuilder
        raise AdaptiveError(f"ZeRO++ quantized communication ({', '.join(quantized)}) needs DeepSpeed's quantizer "
                            "kernels, which it builds for GPUs only; on a CPU use --zero-quantize off (--zero-hpz runs)")
    # a fine-tune runs whole epochs of its data unless told otherwise: the steps are counted once the data are read
    epochs = ft.epochs if ft.epochs is not None else 1.0 if ft.finetune and tokens is None and max_steps is None \
        else None
    max_steps = steps_for(max_steps, tokens, knobs, world.size, plan, cpu)
    requested = config.orchestrator.orchestrator
    enabled = requested == "on" or (requested == "auto" and plan.orchestrator.recommended)
    return RunPlan(preset=preset, arch=arch, plan=plan, knobs=knobs, ds_config=cfg, ds_source=source,
                   precision=precision, device=device, world=world, max_steps=max_steps,
                   orchestrator_requested=requested, orchestrator=enabled, init_from=config.model.init_from,
                   pp_partition=pipeline_partition(par.pp_partition or "parameters"), epochs=epochs)


def pipeline_zero(pp: int, zero: int | None, sp: int, tp: int, ep: int | None, arch: str, world: World) -> int:
    """The ZeRO stage under DeepSpeed's pipeline engine (ZeRO-1 at most; unpinned: 1 over several data-parallel
    replicas, else 0), or one line saying why this layout cannot be pipelined."""
    if world.size % pp:
        raise AdaptiveError(f"--pp-size {pp} must divide the {world.size} processes; nearest that does: "
                            f"{max(d for d in range(1, world.size + 1) if world.size % d == 0 and d <= pp)}")
    if zero is not None and zero >= 2:
        raise AdaptiveError(f"--zero {zero} with --pp-size {pp}: DeepSpeed's pipeline engine takes ZeRO-1 at most "
                            "(\"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism\", "
                            "deepspeed/runtime/pipe/engine.py:76); pin --zero 1 or 0")
    if tp > 1 and arch != "dense":  # TP inside the stages splits dense blocks (adaptive/models/pipeline_tp.py)
        raise AdaptiveError(f"--tp-size {tp} with --pp-size {pp}: only dense blocks are split inside the pipeline's "
                            f"stages, not {arch}'s experts or routers; use one of them")
    if sp > 1:
        raise AdaptiveError(f"--sp-size {sp} with --pp-size {pp}: Ulysses hands deepspeed.initialize its own mpu, "
                            "which the pipeline engine refuses (\"mpu must be None with pipeline parallelism\", "
                            "deepspeed/__init__.py:583); use one of them")
    replicas = world.size // pp
    if ep is not None and ep > 1 and replicas % ep:
        # DeepSpeed builds each stage's expert groups from its data-parallel ranks, which ep must divide
        # (utils/groups.py:634, _ensure_divisibility(dp_world_size, expert_parallel_size_))
        raise AdaptiveError(f"--ep-size {ep} with --pp-size {pp}: the experts are split over a stage's {replicas} "
                            f"data-parallel replicas, which {ep} does not divide; nearest that does: "
                            f"{max(d for d in range(1, replicas + 1) if replicas % d == 0 and d <= ep)}")
    if zero is not None:
        return zero
    # one pipeline: nothing to shard (under --tp-size, ZeRO-1 over the one replica, as fit asks for TP)
    return 0 if world.size // pp == 1 else 1


def pipeline_partition(method: str) -> str:
    """--pp-partition: parameters, uniform or type:REGEX (DeepSpeed's partition_method)."""
    import re

    if method in ("parameters", "uniform"):
        return method
    if method.startswith("type:") and method[5:]:
        try:
            re.compile(method[5:])
            return method
        except re.error as err:
            raise AdaptiveError(f"--pp-partition {method}: not a regular expression ({err})") from None
    raise AdaptiveError(f"--pp-partition must be parameters, uniform or type:REGEX, got {method!r}")


def layout_pins(par: Any, source: DeepSpeedSource) -> dict[str, Any]:
    """--sp-size, --tp-size, --zero-hpz, --zero-quantize and --pp-size, merged with the values a DeepSpeed file
    pins (its sequence_parallel_size, tensor_parallel.autotp_size, zero_optimization.zero_hpz_partition_size,
    zero_quantized_weights/gradients and pipeline.stages: a pipeline the planner chose reaches the recipe there);
    a flag that contradicts the file is an error."""
    pinned = source.pins or {}  # the reader's pins: autotp_size 0 (off) already reads as tp_size 1
    return {key: _merge_pin(key, getattr(par, key), pinned.get(key), source)
            for key in ("sp_size", "tp_size", "zero_hpz", "zero_quantize", "pp_size")}


def zero_plus(layout: dict[str, Any]) -> dict[str, Any]:
    """The ZeRO++ keys pinned (DeepSpeed's zero_optimization names); none when nothing is pinned."""
    out: dict[str, Any] = {}
    if layout.get("zero_hpz") is not None:
        out["zero_hpz_partition_size"] = layout["zero_hpz"]
    if layout.get("zero_quantize") is not None:
        out["zero_quantized_weights"], out["zero_quantized_gradients"] = ZERO_QUANTIZE[layout["zero_quantize"]]
    return out


def steps_for(max_steps: int | None, tokens: float | None, knobs: Knobs, world_size: int, plan: Plan,
              cpu: bool) -> int:
    """--max-steps; else --tokens over the tokens per step; else the plan's training tokens (GPU)
    or a short CPU run."""
    if max_steps is not None:
        return max_steps
    per_step = knobs.tokens_per_step * _data_parallel_ranks(world_size, 1, knobs.tp_size, knobs.pp_size)
    if tokens is not None:
        return max(1, math.ceil(tokens / per_step))
    return CPU_MAX_STEPS if cpu else max(1, math.ceil(plan.train_tokens / per_step))


def finalize_ds_config(base: dict[str, Any], knobs: Knobs, world_size: int, precision: str,
                       clipping: float | None = None, zero_plus_keys: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config accelerate gets: batch sizes, ZeRO layout, sequence and tensor parallelism from the knobs,
    ZeRO++ switches pinned, precision set, clipping filled; only accelerate's hidden-size "auto" values
    remain."""
    cfg = ds_config_for_knobs(base, knobs, world_size)
    if knobs.sp_size > 1:
        cfg["sequence_parallel_size"] = knobs.sp_size
    else:
        cfg.pop("sequence_parallel_size", None)
    if knobs.tp_size > 1 and knobs.pp_size > 1:  # TP inside the pipeline's stages, on its grid: not AutoTP
        cfg.pop("tensor_parallel", None)
    elif knobs.tp_size > 1:
        cfg["tensor_parallel"] = {**(cfg.get("tensor_parallel") or {}), "autotp_size": knobs.tp_size}
        # the HF export gathers the TP shards through DeepSpeed's 16-bit state dict, which this switch allows
        cfg.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True
    elif "tensor_parallel" in cfg:
        cfg["tensor_parallel"] = {**cfg["tensor_parallel"], "autotp_size": 0}  # DeepSpeed's off
    if not _explicit(cfg.get("gradient_clipping")):
        cfg["gradient_clipping"] = clipping if clipping is not None else GRADIENT_CLIPPING
    zero = cfg.setdefault("zero_optimization", {})
    zero["stage"] = knobs.zero_stage
    for key, on in (("offload_optimizer", knobs.offload_optimizer), ("offload_param", knobs.offload_params)):
        section = zero.get(key) or {}
        if on and section.get("device") in (None, "none", "auto"):
            zero[key] = {**section, "device": "cpu", "pin_memory": True}
        elif not on and key in zero:
            zero.pop(key)
    zero.update(zero_plus_keys or {})
    hpz = zero.get("zero_hpz_partition_size", 1)
    quantized = [k for k in ("zero_quantized_weights", "zero_quantized_gradients") if zero.get(k) is True]
    if knobs.zero_stage != 3 and (hpz not in (0, 1, "auto") or quantized):
        what = ", ".join([*(["zero_hpz_partition_size"] if hpz not in (0, 1, "auto") else []), *quantized])
        raise AdaptiveError(f"ZeRO++ ({what}) works on ZeRO-3 partitions; the ZeRO stage is {knobs.zero_stage}: "
                            "pin --zero 3, or leave ZeRO++ off")
    if knobs.offload_optimizer:
        # the loop builds DeepSpeedCPUAdam itself (betas 0.9/0.95); accelerate's own swap would drop the betas
        cfg["zero_force_ds_cpu_optimizer"] = False
    if precision == "bf16":
        cfg["bf16"] = {**(cfg.get("bf16") or {}), "enabled": True}
        cfg.pop("fp16", None)
    elif precision == "fp16":
        section = {k: v for k, v in (cfg.get("fp16") or {}).items() if v != "auto"}
        cfg["fp16"] = {**FP16_SECTION, **section, "enabled": True}
        cfg.pop("bf16", None)
    else:
        cfg.pop("bf16", None)
        cfg.pop("fp16", None)
    return cfg


class _DataParallel:
    """DeepSpeed's `mpu` interface, for the data-parallel size a config is checked against."""

    def __init__(self, size: int):
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        return self.size


def _keys_at(model: Any, loc: tuple) -> list[str]:
    """The keys DeepSpeed's pydantic `model` takes at the section `loc` points into (for a typo hint)."""
    for part in loc[:-1]:
        annotation = getattr(model.model_fields.get(part), "annotation", None)  # X or Optional[X]
        model = next((a for a in (annotation, *getattr(annotation, "__args__", ())) if hasattr(a, "model_fields")), None)
        if model is None:
            return []
    return [*model.model_fields, *(f.alias for f in model.model_fields.values() if f.alias)]


def check_with_deepspeed(cfg: dict[str, Any], world_size: int) -> None:
    """DeepSpeed's own `DeepSpeedConfig` on the final config, where DeepSpeed is installed: what it would
    refuse in `deepspeed.initialize`, after the model is built, is one line now. The global batch is left
    for DeepSpeed to derive (without a process group it counts one process)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return
    from adaptive.engine import nvme_refusal

    refusal = nvme_refusal(cfg)  # ZeRO-Infinity without an async_io op that can run here
    if refusal:
        raise AdaptiveError(refusal)
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    checked = {k: v for k, v in copy.deepcopy(cfg).items() if k != "train_batch_size"}
    sp = cfg.get("sequence_parallel_size") or 1  # Ulysses' mpu divides the world; AutoTP's mesh comes later
    try:
        DeepSpeedConfig(checked, mpu=_DataParallel(max(1, _data_parallel_ranks(world_size, sp, 1))))
    except ValidationError as err:
        section = "zero_optimization" if err.title == DeepSpeedZeroConfig.__name__ else err.title
        known = _keys_at(DeepSpeedZeroConfig, err.errors()[0]["loc"]) if section == "zero_optimization" else ()
        raise from_validation(f"DeepSpeed refuses the config's {section}", err, known) from None
    except (DeepSpeedConfigError, AssertionError, ValueError, TypeError, KeyError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise AdaptiveError(f"DeepSpeed refuses the config: {first}") from None


def ds_config_for_knobs(cfg: dict[str, Any], knobs: Knobs, world_size: int) -> dict[str, Any]:
    """`cfg` with the batch knobs in force written back (after the orchestrator changed them). Under sequence
    parallelism a rank runs the micro-batches of its whole SP group in turn (DeepSpeed's Ulysses data
    adapter), so DeepSpeed counts sp x the accumulation over world / sp data-parallel ranks. Under AutoTP
    DeepSpeed checks the batch against every process (`deepspeed.initialize` reads the config before it
    builds the TP mesh), though a TP group shares its data."""
    out = copy.deepcopy(cfg)
    out["train_micro_batch_size_per_gpu"] = knobs.micro_batch_size
    out["gradient_accumulation_steps"] = knobs.gradient_accumulation_steps * knobs.sp_size
    # a pipeline shares its data, and so do the TP ranks of its stages (DeepSpeed's grid counts replicas)
    replicas = world_size // (knobs.pp_size * knobs.tp_size) if knobs.pp_size > 1 else world_size
    out["train_batch_size"] = knobs.sequences_per_step * replicas
    return out


def replan_for_knobs(plan: Plan, knobs: Knobs) -> Plan:
    """The plan re-estimated at the knobs in force (after the orchestrator changed them), so plan.json's
    memory and speed figures describe what runs; the plan itself when nothing differs, or when the
    planner refuses the combination (its figures then stay those of the original plan)."""
    s, accum = plan.shown.setup, plan.shown.grad_accum
    if (knobs.micro_batch_size, knobs.gradient_accumulation_steps, knobs.checkpoint_policy, knobs.seq_len) == (
            s.micro_batch_size, accum, s.checkpointing, s.seq_len):
        return plan
    offload = "all" if s.offload_params else "optimizer" if s.offload_optimizer else "none"
    request = replace(plan.request, seq_len=knobs.seq_len, min_seq_len=None, zero_stage=s.zero_stage, offload=offload,
                      micro_batch_size=knobs.micro_batch_size, grad_accum=knobs.gradient_accumulation_steps,
                      gradient_checkpointing=knobs.gradient_checkpointing, ep_size=s.ep_size,
                      checkpointing=knobs.checkpoint_policy,
                      global_batch_tokens=knobs.tokens_per_step * plan.request.world_size)
    try:
        return fit(request, suggest=False)
    except AdaptiveError:
        return plan


def with_knobs(plan_json: dict[str, Any], knobs: Knobs) -> dict[str, Any]:
    """plan.json's plan fields updated to the knobs in force (seq_len: the sequence the model sees; the
    run section's knobs also hold `block_len`, the run's --seq-len, whose blocks it cuts)."""
    out = dict(plan_json)
    out.update(micro_batch_size=knobs.micro_batch_size, gradient_accumulation_steps=knobs.gradient_accumulation_steps,
               gradient_checkpointing=knobs.gradient_checkpointing, checkpointing=knobs.checkpoint_policy,
               seq_len=knobs.seq_len)
    return out


__all__ = ["DeepSpeedSource", "Device", "NOMINAL_GPU", "RunPlan", "World", "check_with_deepspeed", "deepspeed_source",
           "detect_device", "ds_config_for_knobs", "finalize_ds_config", "launcher_world", "plan_run",
           "precision_for", "replan_for_knobs", "steps_for", "with_knobs"]
