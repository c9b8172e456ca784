"""A user's DeepSpeed JSON as planner input (`adaptive fit --ds-config FILE`).

Explicit values pin knobs (ZeRO stage, offload, micro-batch, accumulation, global batch) and set what
DeepSpeed allocates from the file (bucket sizes, `overlap_comm`, the optimizer it builds). `"auto"`
values are what accelerate/transformers fill at launch: batch sizes and accumulation are searched
like any free knob; bucket sizes follow transformers' rule (`integrations/deepspeed.py`:
reduce_bucket_size = hidden_size², stage3_prefetch_bucket_size = 0.9·hidden_size²). Keys DeepSpeed
would take but the planner does not model are listed in `ignored`, never dropped silently.

Defaults for keys the file leaves out are DeepSpeed 0.19's (`runtime/zero/config.py`): reduce and
all-gather buckets 5e8 elements, `overlap_comm` off for ZeRO-1/2 and on for ZeRO-3, prefetch 5e7.

The one reader of a DeepSpeed JSON, for `adaptive fit` and the recipes alike: `load(path)` reads the
file, `check` validates the sections the planner and the recipes read (pydantic models, in
`schema.py`), then `parse` gives the planner's input (`read` does all three) and `pins` the knobs a
recipe keeps (layout included). `merge_ds_pins` and `merge_parallel_pins` fill the flags a user left free
from the file and refuse a flag that contradicts it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptive.errors import AdaptiveError
from adaptive.plan.ds_config.schema import AUTO, check

DS_DEFAULT_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's reduce_bucket_size / allgather_bucket_size default
DS_DEFAULT_PREFETCH_ELEMENTS = 50_000_000  # stage3_prefetch_bucket_size default

# Top-level sections the planner reads or knowingly leaves to the launcher.
HANDLED = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
           "zero_optimization", "optimizer", "bf16", "fp16", "gradient_clipping", "scheduler",
           "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
           "zero_force_ds_cpu_optimizer", "sequence_parallel_size", "tensor_parallel", "pipeline"}
# ZeRO++ keys: DeepSpeed reads them under ZeRO-3 only (partition_parameters.py, stage3.py)
ZEROPP_KEYS = ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients")
ZERO_HANDLED = {"stage", "offload_optimizer", "offload_param", "reduce_bucket_size", "allgather_bucket_size",
                "overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions",
                "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                "stage3_param_persistence_threshold", "stage3_gather_16bit_weights_on_model_save",
                "round_robin_gradients", "sub_group_size"}


@dataclass(frozen=True)
class DsConfigInput:
    """What a DeepSpeed JSON pins (None: free, searched) and what it sets."""

    path: str
    zero_stage: int | None
    offload: str | None  # none | optimizer | all; None when the stage is free too
    micro_batch_size: int | None
    grad_accum: int | None
    train_batch_size: int | None  # sequences, all GPUs
    reduce_bucket_elements: int
    allgather_bucket_elements: int
    prefetch_bucket_elements: int
    overlap_comm: bool | None  # None: DeepSpeed's default for the stage
    optimizer: str | None  # optimizers.py name DeepSpeed builds from the file; None: the client's
    precision: str | None  # bf16 | fp16 | None
    sources: tuple[tuple[str, str], ...] = field(default=())  # (knob, "key = value" that set it)
    ignored: tuple[str, ...] = field(default=())
    # beyond data parallelism (issue 12); None: free
    sp_size: int | None = None  # sequence_parallel_size
    tp_size: int | None = None  # tensor_parallel.autotp_size
    zero_hpz: int | None = None  # zero_optimization.zero_hpz_partition_size (ZeRO-3)
    zero_quantized_weights: bool | None = None
    zero_quantized_gradients: bool | None = None
    pp_size: int | None = None  # pipeline.stages

    def overlap_for(self, stage: int) -> bool:
        return self.overlap_comm if self.overlap_comm is not None else stage == 3


def _int(key: str, value: Any, auto_ok: bool = True) -> int | None:
    if value == AUTO and auto_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or int(value) != value:
        allowed = "a positive integer or \"auto\"" if auto_ok else "a positive integer"
        raise AdaptiveError(f"ds_config {key} must be {allowed}, got {value!r}")
    return int(value)


def _enabled(section: Any) -> bool | None:
    if not isinstance(section, dict):
        return None
    value = section.get("enabled", False)
    return None if value == AUTO else bool(value)


def load(path: str, what: str = "--ds-config") -> dict[str, Any]:
    """The checked JSON object of a DeepSpeed config file; AdaptiveError (one line) when it is missing,
    unreadable, not UTF-8, not JSON, not an object, or shaped in a way DeepSpeed would refuse."""
    try:
        data = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AdaptiveError(f"{what} {path!r} does not exist") from None
    except UnicodeDecodeError as e:
        raise AdaptiveError(f"{what} {path!r} is not UTF-8 text (byte {e.start}); give a DeepSpeed JSON file") from None
    except OSError as e:
        raise AdaptiveError(f"cannot read {what} {path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise AdaptiveError(f"{what} {path!r} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    check(data, f"{what} {path!r}")
    return data


def offload_pin(optimizer_device: str | None, param_device: str | None) -> str | None:
    """none | optimizer | all from the two offload devices; None when neither says."""
    devices = {optimizer_device, param_device} - {None, "none", "auto"}
    if not devices:
        return "none" if optimizer_device == "none" or param_device == "none" else None
    return "all" if param_device not in (None, "none", "auto") else "optimizer"


# --zero-quantize's values as (zero_quantized_weights, zero_quantized_gradients)
ZERO_QUANTIZE = {"off": (False, False), "weights": (True, False), "gradients": (False, True), "both": (True, True)}


def zero_quantize_name(weights: Any, gradients: Any) -> str:
    """The --zero-quantize value of a file's zero_quantized_weights/gradients (True is on, anything else off)."""
    return next(k for k, v in ZERO_QUANTIZE.items() if v == (weights is True, gradients is True))


def pins(data: dict[str, Any]) -> dict[str, Any]:
    """The knobs a checked DeepSpeed config fixes (explicit values only): zero, offload, micro_batch,
    grad_accum, clipping, precision, and the layout: sp_size, tp_size (autotp_size 0 is 1, off), zero_hpz,
    zero_quantize (a ZERO_QUANTIZE name)."""
    zero = data.get("zero_optimization") or {}
    out: dict[str, Any] = {}
    if zero.get("stage", AUTO) != AUTO:
        out["zero"] = int(zero["stage"])
    offload = offload_pin((zero.get("offload_optimizer") or {}).get("device"),
                          (zero.get("offload_param") or {}).get("device"))
    if offload is not None:
        out["offload"] = offload
    for pin, key in (("micro_batch", "train_micro_batch_size_per_gpu"), ("grad_accum", "gradient_accumulation_steps")):
        if data.get(key, AUTO) not in (None, AUTO):
            out[pin] = int(data[key])
    if data.get("gradient_clipping", AUTO) not in (None, AUTO):
        out["clipping"] = float(data["gradient_clipping"])
    for name in ("bf16", "fp16"):
        if (data.get(name) or {}).get("enabled") is True:
            out["precision"] = name
    layout = {"sp_size": data.get("sequence_parallel_size"),
              "tp_size": (data.get("tensor_parallel") or {}).get("autotp_size"),
              "zero_hpz": zero.get("zero_hpz_partition_size")}
    layout["pp_size"] = (data.get("pipeline") or {}).get("stages")
    out.update({k: int(v) for k, v in layout.items() if v not in (None, AUTO)})
    if out.get("tp_size") == 0:
        out["tp_size"] = 1
    quantized = [zero.get(k) for k in ("zero_quantized_weights", "zero_quantized_gradients")]
    if any(q not in (None, AUTO) for q in quantized):
        out["zero_quantize"] = zero_quantize_name(*quantized)
    return out


def parse(data: Any, path: str, hidden_size: int) -> DsConfigInput:
    """Read a DeepSpeed config dict; AdaptiveError for values DeepSpeed itself would refuse."""
    check(data, f"ds_config {path!r}")
    sources: list[tuple[str, str]] = []
    ignored = [k for k in data if k not in HANDLED]
    zero = data.get("zero_optimization", {})
    ignored += [f"zero_optimization.{k}" for k in zero if k not in ZERO_HANDLED
                and not (k in ZEROPP_KEYS and zero.get("stage") in (3, AUTO))]

    stage = None
    if "stage" in zero and zero["stage"] != AUTO:
        stage = zero["stage"]
        sources.append(("zero_stage", f"zero_optimization.stage = {stage}"))
    elif "stage" not in zero and "zero_optimization" in data:
        stage = 0  # DeepSpeed's default
        sources.append(("zero_stage", "zero_optimization.stage absent: DeepSpeed's default 0"))

    def device(key: str) -> str | None:
        sec = zero.get(key)
        if not isinstance(sec, dict):
            return None
        dev = sec.get("device", "none")
        return None if dev in (None, "none") else str(dev)

    off_opt, off_param = device("offload_optimizer"), device("offload_param")
    offload = None
    if stage is not None:
        offload = "all" if off_param else "optimizer" if off_opt else "none"
        if off_opt or off_param:
            sources.append(("offload", f"zero_optimization.offload_{'param' if off_param else 'optimizer'}"
                                       f".device = {off_param or off_opt}"))
        for dev in (off_opt, off_param):
            if dev == "nvme":
                ignored.append("offload to nvme (planned as CPU offload; NVMe bandwidth not modelled)")

    micro = _int("train_micro_batch_size_per_gpu", data.get("train_micro_batch_size_per_gpu", AUTO))
    accum = _int("gradient_accumulation_steps", data.get("gradient_accumulation_steps", AUTO))
    global_ = _int("train_batch_size", data.get("train_batch_size", AUTO))
    for knob, key, v in (("micro_batch_size", "train_micro_batch_size_per_gpu", micro),
                         ("grad_accum", "gradient_accumulation_steps", accum),
                         ("global_batch", "train_batch_size", global_)):
        if v is not None:
            sources.append((knob, f"{key} = {v}"))

    def bucket(key: str, default: int, auto_value: int) -> int:
        if key not in zero:
            sources.append((key, f"zero_optimization.{key} absent: DeepSpeed's default {default:.3g}"))
            return default
        if zero[key] == AUTO:
            sources.append((key, f"zero_optimization.{key} = \"auto\": transformers fills {auto_value:,}"))
            return auto_value
        v = _int(f"zero_optimization.{key}", zero[key], auto_ok=False)
        sources.append((key, f"zero_optimization.{key} = {v:.3g}"))
        return v

    reduce = bucket("reduce_bucket_size", DS_DEFAULT_BUCKET_ELEMENTS, hidden_size * hidden_size)
    gather = bucket("allgather_bucket_size", DS_DEFAULT_BUCKET_ELEMENTS, DS_DEFAULT_BUCKET_ELEMENTS)
    prefetch = bucket("stage3_prefetch_bucket_size", DS_DEFAULT_PREFETCH_ELEMENTS, int(0.9 * hidden_size**2))
    overlap = zero.get("overlap_comm")
    if overlap is not None:
        overlap = bool(overlap)
        sources.append(("overlap_comm", f"zero_optimization.overlap_comm = {str(overlap).lower()}"))

    optimizer = None
    opt = data.get("optimizer")
    if isinstance(opt, dict):
        kind = str(opt.get("type", "")).lower()
        params = opt.get("params", {}) or {}
        if kind not in ("adam", "adamw"):
            ignored.append(f"optimizer.type {opt.get('type')!r} (planned as Adam-family states: 12 bytes/param)")
        if params.get("torch_adam"):
            # foreach or not: on DeepSpeed's flat fp32 partition the for-loop path's `exp_avg_sq.sqrt()` is a
            # temporary of the same size, so both are `adamw_torch`
            optimizer = "adamw_torch"
            sources.append(("optimizer", "optimizer.params.torch_adam = true: torch AdamW, whose step "
                                         "keeps an fp32 temporary per parameter"))
        elif off_opt:
            optimizer = "deepspeed_cpu_adam"
            sources.append(("optimizer", f"optimizer.type = {opt.get('type')} with optimizer offload: "
                                         "DeepSpeedCPUAdam"))
        else:
            optimizer = "deepspeed_fused_adam"
            sources.append(("optimizer", f"optimizer.type = {opt.get('type')}: DeepSpeed FusedAdam"))

    parallel: dict[str, Any] = {}
    for knob, key, value in (("sp_size", "sequence_parallel_size", data.get("sequence_parallel_size")),
                             ("tp_size", "tensor_parallel.autotp_size",
                              (data.get("tensor_parallel") or {}).get("autotp_size"))):
        if value not in (None, AUTO):
            v = 1 if value == 0 and knob == "tp_size" else _int(key, value, auto_ok=False)  # autotp_size 0: off
            parallel[knob] = v
            sources.append((knob, f"{key} = {value}"))
    if zero.get("stage") in (3, AUTO):
        for knob, key in (("zero_hpz", "zero_hpz_partition_size"), ("zero_quantized_weights", "zero_quantized_weights"),
                          ("zero_quantized_gradients", "zero_quantized_gradients")):
            if key in zero:
                if knob == "zero_hpz":  # 0 and 1 both mean no secondary partition
                    value = 1 if zero[key] == 0 else _int(f"zero_optimization.{key}", zero[key], auto_ok=False)
                else:
                    value = bool(zero[key])
                parallel[knob] = value
                sources.append((knob, f"zero_optimization.{key} = {zero[key]}"))

    # DeepSpeed's config declares pipeline.stages ("auto" by default, runtime/config.py:274-281) but its engine
    # takes the stage count from the PipelineModule (pipe/module.py:125-183), which our recipes build from the plan:
    # a number there pins the plan's pipeline. Of the section, the engine reads pipe_partitioned, grad_partitioned
    # (pipe/engine.py:135-138) and activation_checkpoint_interval (:217); the planner models the first two's
    # defaults (on) and not the third.
    pipe = data.get("pipeline") or {}
    if pipe.get("stages", AUTO) != AUTO:
        parallel["pp_size"] = _int("pipeline.stages", pipe["stages"], auto_ok=False)
        sources.append(("pp_size", f"pipeline.stages = {pipe['stages']}"))
    ignored += [f"pipeline.{k}" for k in pipe if k not in ("stages", "partition", "pipe_partitioned", "grad_partitioned")
                or (k in ("pipe_partitioned", "grad_partitioned") and pipe[k] is not True)]
    bf16, fp16 = _enabled(data.get("bf16")), _enabled(data.get("fp16"))
    precision = "bf16" if bf16 else "fp16" if fp16 else None
    return DsConfigInput(path=path, zero_stage=stage, offload=offload, micro_batch_size=micro, grad_accum=accum,
                         train_batch_size=global_, reduce_bucket_elements=reduce, allgather_bucket_elements=gather,
                         prefetch_bucket_elements=prefetch, overlap_comm=overlap, optimizer=optimizer,
                         precision=precision, sources=tuple(sources), ignored=tuple(ignored), **parallel)


def drivers(ds: DsConfigInput, parts: dict[str, int], zero_stage: int) -> list[tuple[str, int, str]]:
    """(memory part, bytes, what in the file set it) for the parts the file decides."""
    out = []
    src = dict(ds.sources)
    if parts.get("comm_buckets"):
        if zero_stage in (1, 2):
            why = src.get("reduce_bucket_size", "")
            copies = 2 if ds.overlap_for(zero_stage) else 1
            why += f" x {copies} ({'double-buffered: overlap_comm on' if copies == 2 else 'overlap_comm off'})"
        else:
            why = f"{src.get('reduce_bucket_size', '')}; {src.get('stage3_prefetch_bucket_size', '')}"
        out.append(("comm_buckets", parts["comm_buckets"], why))
    if parts.get("optimizer_transient") and "optimizer" in src:
        out.append(("optimizer_transient", parts["optimizer_transient"], src["optimizer"]))
    for part, knob in (("optimizer", "offload"), ("grads", "offload")):
        if knob in src and part in parts:
            out.append((part, parts[part], src[knob]))
    if "zero_stage" in src:
        out.append(("model states", parts.get("params", 0) + parts.get("grads", 0) + parts.get("optimizer", 0),
                    src["zero_stage"]))
    return out


def merge_ds_pins(ds: DsConfigInput, *, zero: int | None, offload: str | None, micro_batch: int | None,
                  grad_accum: int | None, optimizer: str | None, global_batch_tokens: int | None,
                  seq_len: int) -> tuple:
    """The file's explicit values fill the knobs the flags leave free; a flag that contradicts the file
    is an error. Returns (zero, offload, micro_batch, grad_accum, optimizer, global_batch_tokens)."""
    pins = {"--zero": (zero, ds.zero_stage, "zero_stage"), "--offload": (offload, ds.offload, "offload"),
            "--micro-batch": (micro_batch, ds.micro_batch_size, "micro_batch_size"),
            "--grad-accum": (grad_accum, ds.grad_accum, "grad_accum"),
            "--optimizer": (optimizer, ds.optimizer, "optimizer")}
    sources = dict(ds.sources)
    for flag, (given, pinned, knob) in pins.items():
        if given is not None and pinned is not None and given != pinned:
            raise AdaptiveError(f"{flag} {given} contradicts {ds.path} ({sources.get(knob, pinned)}); "
                                "drop the flag or edit the file")
    if global_batch_tokens is None and ds.train_batch_size is not None:
        global_batch_tokens = ds.train_batch_size * seq_len
    return (zero if zero is not None else ds.zero_stage, offload if offload is not None else ds.offload,
            micro_batch or ds.micro_batch_size, grad_accum or ds.grad_accum, optimizer or ds.optimizer,
            global_batch_tokens)


def merge_parallel_pins(ds: DsConfigInput, sp_size: int | None, tp_size: int | None, zero_hpz: int | None,
                        zero_quantize: str | None) -> tuple:
    """The file's SP, TP and ZeRO++ settings fill the flags left free; a flag that contradicts the file is
    an error. Returns (sp_size, tp_size, zero_hpz, zero_quantize)."""
    sources = dict(ds.sources)
    file_quant = None
    if ds.zero_quantized_weights is not None or ds.zero_quantized_gradients is not None:
        file_quant = zero_quantize_name(ds.zero_quantized_weights, ds.zero_quantized_gradients)
    pins = {"--sp-size": (sp_size, ds.sp_size, "sp_size"), "--tp-size": (tp_size, ds.tp_size, "tp_size"),
            "--zero-hpz": (zero_hpz, ds.zero_hpz, "zero_hpz"),
            "--zero-quantize": (zero_quantize, file_quant, "zero_quantized_weights")}
    for flag, (given, pinned, knob) in pins.items():
        if given is not None and pinned is not None and given != pinned:
            raise AdaptiveError(f"{flag} {given} contradicts {ds.path} ({sources.get(knob, pinned)}); "
                                "drop the flag or edit the file")
    return (sp_size if sp_size is not None else ds.sp_size, tp_size if tp_size is not None else ds.tp_size,
            zero_hpz if zero_hpz is not None else ds.zero_hpz,
            zero_quantize if zero_quantize is not None else file_quant)


def merge_pp_pin(ds: DsConfigInput, pp_size: int | None) -> int | None:
    """The file's pipeline.stages fills a free --pp-size; a flag that contradicts it is an error."""
    if pp_size is not None and ds.pp_size is not None and pp_size != ds.pp_size:
        raise AdaptiveError(f"--pp-size {pp_size} contradicts {ds.path} (pipeline.stages = {ds.pp_size}); "
                            "drop the flag or edit the file")
    return pp_size if pp_size is not None else ds.pp_size


def read(path: str, hidden_size: int) -> DsConfigInput:
    """Load, check and parse a DeepSpeed JSON (--ds-config); AdaptiveError when it cannot be used."""
    return parse(load(path), str(path), hidden_size)


__all__ = ["ZERO_QUANTIZE", "DsConfigInput", "drivers", "load", "merge_ds_pins", "merge_parallel_pins", "merge_pp_pin",
           "offload_pin",
           "parse", "pins", "read"]
