"""Turn what a user typed (names, GiB, flags) into a FitRequest. No I/O beyond reading a config.json."""

from __future__ import annotations

from dataclasses import replace

from adaptive.config.run import RunConfig
from adaptive.errors import AdaptiveError, require_positive
from adaptive.plan.calibration import load as load_calibration
from adaptive.plan.gpus import GiB, GPU, custom_gpu, get_gpu
from adaptive.plan.hf_config import default_kernels, looks_like_path, spec_from_hf_config
from adaptive.plan.planner import FitRequest
from adaptive.plan.presets import ModelSpec, preset_spec


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
                 calibrate: str | None = None, kernels: str | None = None,
                 checkpoint_policy: str | None = None) -> FitRequest:
    """`kernels` None: "lean" for adaptive's models, "plain" for a config.json transformers' class trains."""
    require_positive("--host-mem", host_mem_gib)
    spec = resolve_model(model, arch, mod_capacity)
    return FitRequest(
        spec=spec,
        gpu=resolve_gpu(gpu, gpu_mem_gib, gpu_tflops, price),
        gpus_per_node=gpus, num_nodes=nodes, seq_len=seq_len, min_seq_len=min_seq_len,
        global_batch_tokens=global_batch_tokens, train_tokens=tokens, zero_stage=zero, offload=offload,
        micro_batch_size=micro_batch, grad_accum=grad_accum, gradient_checkpointing=checkpointing,
        ep_size=ep_size, capacity_factor=capacity_factor, mfu=mfu,
        host_mem_bytes=int(host_mem_gib * GiB) if host_mem_gib is not None else None,
        calibration=load_calibration(calibrate, spec, capacity_factor) if calibrate else None,
        kernels=kernels or default_kernels(spec),
        checkpointing=checkpoint_policy,
    )


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
        kernels=m.kernels, checkpoint_policy=config.checkpointing.checkpoint_policy)
