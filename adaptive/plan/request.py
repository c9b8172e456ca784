"""Turn what a user typed (names, GiB, flags) into a FitRequest. No I/O beyond reading a config.json."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from adaptive.config.run import RunConfig
from adaptive.errors import AdaptiveError, require_positive
from adaptive.plan.estimate.attention import ATTENTIONS
from adaptive.plan.hardware.gpus import GiB, GPU, custom_gpu, get_gpu
from adaptive.plan.architecture.families import family_of
from adaptive.plan.architecture.hf_config import default_kernels, looks_like_path, spec_from_hf_config
from adaptive.plan.estimate.optimizers import check_optimizer
from adaptive.plan.finetune.method import Finetune, make_finetune
from adaptive.plan.quality.predict import resolve_law
from adaptive.plan.search.planner import FitRequest
from adaptive.plan.search.tight import parse_headroom
from adaptive.plan.architecture.presets import ModelSpec, preset_spec

if TYPE_CHECKING:  # --ds-config and --calibrate import what they read when given (a plain fit starts sooner)
    from adaptive.plan.estimate.nvme import NvmeDrive
    from adaptive.plan.evidence.run_calibration import RunMeasurement


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
                 calibrate: str | None = None, optimizer: str | None = None, attention: str | None = None,
                 ds_config: str | None = None, kernels: str | None = None,
                 checkpoint_policy: str | None = None, sp_size: int | None = None, tp_size: int | None = None,
                 zero_hpz: int | None = None, zero_quantize: str | None = None, loss_law: str | None = None,
                 dataset_tokens: float | None = None, lr: float | None = None,
                 pp_size: int | None = None, finetune: str | None = None, lora_rank: int | None = None,
                 lora_alpha: float | None = None, lora_targets: str | None = None, lora_dropout: float | None = None,
                 epochs: float | None = None, nvme_path: str | None = None,
                 nvme_gbps: str | None = None, framework: str = "deepspeed", precision: str = "mixed",
                 loss: str | None = None, optimizer_in_backward: bool = False,
                 activation_offload: bool = False, headroom: str | None = None) -> FitRequest:
    """`kernels` None: "lean" for adaptive's models, "plain" for a config.json transformers' class trains.
    `framework`, `precision`, `loss`, `optimizer_in_backward`, `activation_offload`: another stack's memory behaviour
    (estimate/memory.py FRAMEWORKS and PRECISIONS, estimate/losses.py LOSSES); the defaults are adaptive's own.
    `headroom`: --headroom's text (GiB or a percentage); None keeps the corpus's default free (search/tight.py)."""
    require_positive("--host-mem", host_mem_gib)
    spec = resolve_model(model, arch, mod_capacity)
    method = resolve_finetune(finetune, lora_rank, lora_alpha, lora_targets, lora_dropout, epochs)
    attention = attention or family_of(spec).default_attention
    if attention not in ATTENTIONS:
        raise AdaptiveError(f"--attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    optimizer = check_optimizer(optimizer) if optimizer else None
    ds = None
    if ds_config:
        from adaptive.plan.ds_config.reader import merge_ds_pins, merge_parallel_pins, merge_pp_pin, read

        ds = read(ds_config, spec.hidden_size)
        merged = merge_ds_pins(ds, zero=zero, offload=offload, micro_batch=micro_batch, grad_accum=grad_accum,
                               optimizer=optimizer, global_batch_tokens=global_batch_tokens, seq_len=seq_len)
        zero, offload, micro_batch, grad_accum, optimizer, global_batch_tokens = merged
        sp_size, tp_size, zero_hpz, zero_quantize = merge_parallel_pins(ds, sp_size, tp_size, zero_hpz, zero_quantize)
        pp_size = merge_pp_pin(ds, pp_size)
    activations, run, source = None, None, None
    if calibrate:
        from adaptive.plan.estimate.calibration import load as load_calibration
        from adaptive.plan.evidence.run_calibration import CALIBRATION_FILE

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
        host_mem_bytes=int(host_mem_gib * GiB) if host_mem_gib is not None else None, headroom=parse_headroom(headroom),
        calibration=activations, optimizer=optimizer or "auto", attention=attention, ds_config=ds,
        calibrated=(f"activations (measured at seq {activations.seq_len}: {activations.method})",) if activations else (),
        kernels=kernels or default_kernels(spec),
        checkpointing=checkpoint_policy,
        calibration_source=source,
        sp_size=sp_size, tp_size=tp_size, pp_size=pp_size, zero_hpz=zero_hpz,
        zero_quantized_weights=None if zero_quantize is None else zero_quantize in ("weights", "both"),
        zero_quantized_gradients=None if zero_quantize is None else zero_quantize in ("gradients", "both"),
        loss_model=resolve_law(loss_law), unique_tokens=dataset_tokens, lr=lr,
        finetune=method, epochs=epochs, nvme=resolve_nvme(nvme_path, nvme_gbps),
        nvme_path=None if nvme_path is None else str(Path(nvme_path).expanduser()),
        framework=framework, precision=precision, loss=loss, optimizer_in_backward=optimizer_in_backward,
        activation_offload=activation_offload,
    )
    if run is None:
        return request
    from adaptive.plan.evidence.run_calibration import calibrate as calibrate_with_run

    return calibrate_with_run(request, run)


def resolve_finetune(method: str | None, rank: int | None, alpha: float | None, targets: str | None,
                     dropout: float | None, epochs: float | None) -> Finetune | None:
    """--finetune and its LoRA options; the LoRA options and --epochs need --finetune."""
    if method is None:
        for flag, value in (("--lora-rank", rank), ("--lora-alpha", alpha), ("--lora-targets", targets),
                            ("--lora-dropout", dropout), ("--epochs", epochs)):
            if value is not None:
                raise AdaptiveError(f"{flag} applies to a fine-tune: give --finetune lora or qlora"
                                    + (" (or full)" if flag == "--epochs" else ""))
        return None
    return make_finetune(method, rank, alpha, targets, dropout)


def resolve_nvme(path: str | None, gbps: str | None) -> NvmeDrive | None:
    """The NVMe drive ZeRO-Infinity swaps to: --nvme-path must be a folder this user can write; --nvme-gbps is
    READ[/WRITE] in GB/s (default: a PCIe 4.0 drive's datasheet figures, estimate/nvme.py)."""
    import os

    from adaptive.plan.estimate.nvme import DEFAULT_DRIVE, NvmeDrive

    if path is None:
        if gbps is not None:
            raise AdaptiveError("--nvme-gbps describes the drive of --nvme-path: give --nvme-path DIR too")
        return None
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise AdaptiveError(f"--nvme-path {path!r} is not a folder; give an existing folder on the NVMe drive")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise AdaptiveError(f"--nvme-path {path!r} is not writable by this user; DeepSpeed writes its swap files there")
    if gbps is None:
        return DEFAULT_DRIVE
    read, _, write = gbps.partition("/")
    r, w = float(read), float(write or read)
    for name, v in (("read", r), ("write", w)):
        if not 0 < v < 1000:
            raise AdaptiveError(f"--nvme-gbps {gbps!r}: the {name} speed must be between 0 and 1000 GB/s")
    return NvmeDrive(read_gbps=r, write_gbps=w, source="given (--nvme-gbps)")


def load_run(run_dir: str) -> RunMeasurement:
    """The measurements in RUN_DIR/metrics.jsonl; AdaptiveError when missing or malformed."""
    from adaptive.plan.evidence.run_calibration import METRICS_FILE as RUN_METRICS_FILE
    from adaptive.plan.evidence.run_calibration import parse_records as parse_run_records

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
        tp_size=par.tp_size, zero_hpz=par.zero_hpz, zero_quantize=par.zero_quantize, loss_law=config.quality.loss_law,
        dataset_tokens=config.quality.dataset_tokens, lr=config.optimizer.lr, pp_size=par.pp_size,
        finetune=config.finetune.finetune, lora_rank=config.finetune.lora_rank, lora_alpha=config.finetune.lora_alpha,
        lora_targets=config.finetune.lora_targets, lora_dropout=config.finetune.lora_dropout,
        epochs=config.finetune.epochs, nvme_path=par.nvme_path, nvme_gbps=par.nvme_gbps, headroom=hw.headroom)
