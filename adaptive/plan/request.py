"""Turn what a user typed (names, GiB, flags) into a FitRequest. No I/O beyond reading a config.json."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from adaptive.config.run import RunConfig
from adaptive.errors import AdaptiveError, require_positive
from adaptive.plan.attention import ATTENTIONS
from adaptive.plan.gpus import GiB, GPU, custom_gpu, get_gpu
from adaptive.plan.hf_config import default_kernels, looks_like_path, spec_from_hf_config
from adaptive.plan.optimizers import check_optimizer
from adaptive.plan.planner import FitRequest
from adaptive.plan.presets import ModelSpec, preset_spec

if TYPE_CHECKING:  # --ds-config and --calibrate import what they read when given (a plain fit starts sooner)
    from adaptive.plan.ds_config_input import DsConfigInput
    from adaptive.plan.run_calibration import RunMeasurement


def resolve_model(model: str, arch: str | None = None, mod_capacity: float | None = None) -> ModelSpec:
    """A preset name (`b7`) or a path to an HF config.json / model folder."""
    if looks_like_path(model):
        spec = spec_from_hf_config(model, arch)
    else:
        spec = preset_spec(model.lower(), arch or "dense")
    if mod_capacity is not None:
        if not spec.is_mod:
            raise AdaptiveError(f"--mod-capacity applies to mod and hybrid models, not {spec.arch}")
        if not 0 < mod_capacity <= 1:
            raise AdaptiveError(f"--mod-capacity must be in (0, 1], got {mod_capacity}")
        spec = replace(spec, mod_capacity=mod_capacity)
    return spec


def resolve_gpu(gpu: str | None, gpu_mem_gib: float | None = None, gpu_tflops: float | None = None,
                price: float | None = None) -> GPU:
    base = get_gpu(gpu) if gpu else None
    if base is not None and gpu_mem_gib is None and gpu_tflops is None and price is None:
        return base
    return custom_gpu(base, gpu_mem_gib, gpu_tflops, price)


def make_request(*, model: str, gpu: str | None, arch: str | None = None, gpus: int = 1, nodes: int = 1,
                 seq_len: int = 2048, min_seq_len: int | None = None, global_batch_tokens: int | None = None,
                 tokens: float | None = None, zero: int | None = None, offload: str | None = None,
                 micro_batch: int | None = None, grad_accum: int | None = None,
                 checkpointing: bool | None = None, ep_size: int | None = None,
                 capacity_factor: float = 1.0, mod_capacity: float | None = None, mfu: float | None = None,
                 price: float | None = None, host_mem_gib: float | None = None,
                 gpu_mem_gib: float | None = None, gpu_tflops: float | None = None,
                 calibrate: str | None = None, optimizer: str | None = None, attention: str = "sdpa",
                 ds_config: str | None = None, kernels: str | None = None,
                 checkpoint_policy: str | None = None, sp_size: int | None = None, tp_size: int | None = None,
                 zero_hpz: int | None = None, zero_quantize: str | None = None) -> FitRequest:
    """`kernels` None: "lean" for adaptive's models, "plain" for a config.json transformers' class trains."""
    require_positive("--host-mem", host_mem_gib)
    spec = resolve_model(model, arch, mod_capacity)
    if attention not in ATTENTIONS:
        raise AdaptiveError(f"--attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    optimizer = check_optimizer(optimizer) if optimizer else None
    ds = load_ds_config(ds_config, spec.hidden_size) if ds_config else None
    if ds is not None:
        merged = merge_ds_pins(ds, zero=zero, offload=offload, micro_batch=micro_batch, grad_accum=grad_accum,
                               optimizer=optimizer, global_batch_tokens=global_batch_tokens, seq_len=seq_len)
        zero, offload, micro_batch, grad_accum, optimizer, global_batch_tokens = merged
        sp_size, tp_size, zero_hpz, zero_quantize = merge_parallel_pins(ds, sp_size, tp_size, zero_hpz, zero_quantize)
    activations, run, source = None, None, None
    if calibrate:
        from adaptive.plan.calibration import load as load_calibration
        from adaptive.plan.run_calibration import CALIBRATION_FILE

        source = f"{'run folder' if Path(calibrate).is_dir() else 'calibration file'} {calibrate}"
        if Path(calibrate).is_dir():  # a run folder: its metrics, and its activation calibration file if any
            run = load_run(calibrate)
            cal_file = Path(calibrate) / CALIBRATION_FILE
            activations = load_calibration(cal_file, spec, capacity_factor) if cal_file.exists() else None
        else:
            activations = load_calibration(calibrate, spec, capacity_factor)
    request = FitRequest(
        spec=spec,
        gpu=resolve_gpu(gpu, gpu_mem_gib, gpu_tflops, price),
        gpus_per_node=gpus, num_nodes=nodes, seq_len=seq_len, min_seq_len=min_seq_len,
        global_batch_tokens=global_batch_tokens, train_tokens=tokens, zero_stage=zero, offload=offload,
        micro_batch_size=micro_batch, grad_accum=grad_accum, gradient_checkpointing=checkpointing,
        ep_size=ep_size, capacity_factor=capacity_factor, mfu=mfu,
        host_mem_bytes=int(host_mem_gib * GiB) if host_mem_gib is not None else None,
        calibration=activations, optimizer=optimizer or "auto", attention=attention, ds_config=ds,
        calibrated=(f"activations (measured at seq {activations.seq_len}: {activations.method})",) if activations else (),
        kernels=kernels or default_kernels(spec),
        checkpointing=checkpoint_policy,
        calibration_source=source,
        sp_size=sp_size, tp_size=tp_size, zero_hpz=zero_hpz,
        zero_quantized_weights=None if zero_quantize is None else zero_quantize in ("weights", "both"),
        zero_quantized_gradients=None if zero_quantize is None else zero_quantize in ("gradients", "both"),
    )
    if run is None:
        return request
    from adaptive.plan.run_calibration import calibrate as calibrate_with_run

    return calibrate_with_run(request, run)


def load_run(run_dir: str) -> RunMeasurement:
    """The measurements in RUN_DIR/metrics.jsonl; AdaptiveError when missing or malformed."""
    from adaptive.plan.run_calibration import METRICS_FILE as RUN_METRICS_FILE
    from adaptive.plan.run_calibration import parse_records as parse_run_records

    import json  # only where a file is read: a preset's plan needs no json

    path = Path(run_dir) / RUN_METRICS_FILE
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise AdaptiveError(f"--calibrate {run_dir!r}: no {RUN_METRICS_FILE} in that folder; run a recipe with "
                            "--output-dir there first") from None
    except (OSError, json.JSONDecodeError) as e:
        raise AdaptiveError(f"--calibrate {run_dir!r}: cannot read {RUN_METRICS_FILE}: {e}") from None
    try:
        return parse_run_records(records, str(run_dir))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, AdaptiveError):
            raise
        raise AdaptiveError(f"--calibrate {run_dir!r}: malformed {RUN_METRICS_FILE} record: {e}") from None


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
        w, g = bool(ds.zero_quantized_weights), bool(ds.zero_quantized_gradients)
        file_quant = "both" if w and g else "weights" if w else "gradients" if g else "off"
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


def load_ds_config(path: str, hidden_size: int) -> DsConfigInput:
    """Read, check and parse a DeepSpeed JSON (--ds-config); AdaptiveError when it cannot be used."""
    from adaptive.plan.ds_config_input import load as load_ds_file, parse as parse_ds_config

    return parse_ds_config(load_ds_file(path), str(path), hidden_size)


def request_from_config(config: RunConfig, *, model: str = "b7", calibrate: str | None = None) -> FitRequest:
    """The planner's request for a run configuration; `model` when it names none (fit's default)."""
    m, hw, d, par = config.model, config.hardware, config.data, config.parallelism
    return make_request(
        model=m.name or model, gpu=hw.gpu, arch=m.arch, gpus=hw.gpus or 1, nodes=hw.nodes or 1,
        seq_len=d.seq_len or 2048, min_seq_len=d.min_seq_len, global_batch_tokens=config.schedule.global_batch_tokens,
        tokens=config.schedule.tokens, zero=par.zero, offload=par.offload, micro_batch=par.micro_batch,
        grad_accum=par.grad_accum, checkpointing=config.checkpointing.gradient_checkpointing, ep_size=par.ep_size,
        capacity_factor=m.capacity_factor, mod_capacity=m.mod_capacity, mfu=hw.mfu, price=hw.price,
        host_mem_gib=hw.host_mem, gpu_mem_gib=hw.gpu_mem, gpu_tflops=hw.gpu_tflops, calibrate=calibrate,
        optimizer=config.optimizer.optimizer, attention=m.attention, ds_config=par.ds_config,
        kernels=m.kernels, checkpoint_policy=config.checkpointing.checkpoint_policy, sp_size=par.sp_size,
        tp_size=par.tp_size, zero_hpz=par.zero_hpz, zero_quantize=par.zero_quantize)
