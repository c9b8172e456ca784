"""Put the planner's prediction next to a measurement of the same settings, part by part."""

from __future__ import annotations

from dataclasses import dataclass, replace

from adaptive.fidelity.measure import Measurement, checkpoint_policy, measure_step, transformers_class_builds
from adaptive.plan.architecture.hf_config import looks_like_path, read_config_json
from adaptive.plan.estimate.memory import (STAGE3_PREFETCH_ELEMENTS, TrainSetup, estimate_memory, reduce_bucket_elements,
                                           trained_counts)
from adaptive.plan.architecture.params import count_params
from adaptive.plan.search.planner import FitRequest


@dataclass(frozen=True)
class PartComparison:
    name: str
    predicted_bytes: int
    measured_bytes: int

    @property
    def error(self) -> float:
        return self.predicted_bytes / self.measured_bytes - 1 if self.measured_bytes else 0.0


@dataclass(frozen=True)
class FidelityReport:
    setup: TrainSetup
    measurement: Measurement
    parts: tuple[PartComparison, ...]

    @property
    def worst(self) -> PartComparison:
        return max(self.parts, key=lambda p: abs(p.error))


def setup_for(request: FitRequest, zero_stage: int, micro_batch: int, checkpointing: bool | str,
              kernels: str | None = None) -> TrainSetup:
    """One GPU's setup: measurements run one process, so ZeRO partitions over one GPU."""
    policy = checkpoint_policy(checkpointing)
    return TrainSetup(spec=request.spec, seq_len=request.seq_len, micro_batch_size=micro_batch,
                      zero_stage=zero_stage, offload_optimizer=False, offload_params=False,
                      gradient_checkpointing=policy == "full", capacity_factor=request.capacity_factor,
                      kernels=kernels or request.kernels, attention=request.attention,
                      checkpoint_policy=None if policy in ("off", "full") else policy, finetune=request.finetune)


def compare(request: FitRequest, model_arg: str, *, zero_stage: int = 0, micro_batch: int = 1,
            checkpointing: bool | str = False, full_depth: bool = False) -> FidelityReport:
    """Measure `request`'s model at the given settings and compare with `estimate_memory`."""
    hf_config = read_config_json(model_arg) if looks_like_path(model_arg) else None
    # transformers' classes run their own (plain) ops whatever the request says
    kernels = "plain" if transformers_class_builds(request.spec, hf_config) else request.kernels
    setup = setup_for(request, zero_stage, micro_batch, checkpointing, kernels)
    predicted = estimate_memory(setup)
    counts = trained_counts(setup, count_params(request.spec))  # the buckets carry what trains
    buckets: int | tuple[int, ...] = 0
    if zero_stage in (1, 2):
        buckets = reduce_bucket_elements(counts)  # two, double-buffered
    elif zero_stage == 3:
        buckets = (reduce_bucket_elements(counts), min(STAGE3_PREFETCH_ELEMENTS, counts.total))
    dtype = "bf16" if request.gpu.bf16 else "fp16"
    m = measure_step(request.spec, setup.seq_len, micro_batch, checkpointing, zero_stage=zero_stage, dtype=dtype,
                     hf_config=hf_config, bucket_elements=buckets, full_depth=full_depth,
                     capacity_factor=request.capacity_factor, kernels=kernels, finetune=request.finetune,
                     attn_implementation=request.attention)
    p = predicted.parts
    # ZeRO-3 gathers each layer's parameters during forward and backward (4 bytes x the largest layer in
    # the plan). That is DeepSpeed's runtime, which a one-process fake step does not run: left out of
    # both sides, and the method says so.
    live = p["zero3_live_params"]
    backward, peak = predicted.backward_bytes - live, predicted.persistent_bytes + max(
        predicted.backward_bytes - live, predicted.step_bytes)
    if live:
        m = replace(m, method=f"{m.method}; ZeRO-3's gathered-parameter buffer ({live / 2**30:.3f} GiB in the "
                              "plan) is DeepSpeed runtime this step does not run, so it is left out of the "
                              "backward and peak figures on both sides")
    parts = (
        PartComparison("activations (saved for backward)", predicted.saved_bytes, m.phases.activations),
        PartComparison("backward phase (activations + working set)", backward, m.phases.backward),
        PartComparison("model states and buffers between steps", predicted.persistent_bytes, m.phases.persistent),
        PartComparison("optimizer step (fp32 gradients)", predicted.step_bytes, m.phases.step),
        PartComparison("peak (allocated, no allowances)", peak, m.peak_bytes),
    )
    return FidelityReport(setup, m, parts)


def report_dict(report: FidelityReport) -> dict:
    s = report.setup
    return {
        "model": s.spec.name,
        "arch": s.spec.arch,
        "seq_len": s.seq_len,
        "micro_batch_size": s.micro_batch_size,
        "gradient_checkpointing": s.gradient_checkpointing,
        "checkpointing": s.checkpointing,
        "zero_stage": s.zero_stage,
        "kernels": s.kernels,
        "method": report.measurement.method,
        "depths_built": list(report.measurement.depths),
        "layers": report.measurement.layers_total,
        "parts": [{"name": p.name, "predicted_bytes": p.predicted_bytes, "measured_bytes": p.measured_bytes,
                   "error": p.error} for p in report.parts],
        "worst_error": report.worst.error,
    }
