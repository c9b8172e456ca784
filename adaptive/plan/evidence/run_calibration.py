"""Calibrate a plan with a real run's measurements (`adaptive fit --calibrate RUN_DIR`).

A recipe run writes `RUN_DIR/metrics.jsonl` (adaptive/train/reporting/metrics.py): a "start" record with the GPU,
the knobs in force and the world size, then "train" records with tokens/s and, on a GPU, the peak
allocated bytes of each interval. From those:

- measured compute scale: measured over modelled compute time at the run's own knobs (communication,
  all-to-all and offload kept as modelled); every candidate's modelled compute on that GPU is scaled by it;
- measured peak correction: the run's peak allocated bytes over the memory model's allocated peak at
  the run's own knobs. Every candidate on that GPU has its allocated peak scaled by it (the
  allowances for fragmentation and context are then added as usual).

The first train record is left out when there are more (warm-up). A run folder may also hold the
activation calibration file `calibration.json` (`adaptive measure --save-calibration`). Pure: the
records come in as dicts; request.py reads the files.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from adaptive.errors import AdaptiveError
from adaptive.plan.estimate.memory import corrected  # noqa: F401 (in __all__: the correction a run measures)
from adaptive.plan.architecture.params import count_params

METRICS_FILE = "metrics.jsonl"
CALIBRATION_FILE = "calibration.json"


@dataclass(frozen=True)
class RunMeasurement:
    run_dir: str
    gpu: str
    world_size: int
    params_total: int
    micro_batch_size: int
    grad_accum: int
    seq_len: int
    checkpointing: bool
    zero_stage: int
    offload: str
    ep_size: int
    tokens_per_s: float  # all GPUs, median over train records
    peak_allocated_bytes: int  # max over train records
    records: int  # train records used


def parse_records(records: list[dict], run_dir: str) -> RunMeasurement:
    """The measurement in a run's metrics records; AdaptiveError when it lacks what calibration needs."""
    starts = [r for r in records if r.get("kind") == "start"]
    train = [r for r in records if r.get("kind") == "train"]
    where = f"{run_dir}/{METRICS_FILE}"
    if not starts or not train:
        raise AdaptiveError(f"{where} has no start and train records; run a recipe first")
    start = starts[-1]
    if not start.get("gpu"):
        raise AdaptiveError(f"{where} was not measured on a catalog GPU (gpu is null): nothing to calibrate")
    used = train[1:] if len(train) > 1 else train
    speeds = [r["tokens_per_s"] for r in used if r.get("tokens_per_s")]
    peaks = [r["memory"]["peak_allocated_bytes"] for r in used if r.get("memory")]
    if not speeds or not peaks:
        raise AdaptiveError(f"{where} has no measured tokens/s and GPU peak memory in its train records")
    k = dict(start["knobs"], **(used[0].get("knobs") or {}))  # the knobs in force when it was measured
    offload = "all" if k.get("offload_params") else "optimizer" if k.get("offload_optimizer") else "none"
    return RunMeasurement(run_dir=run_dir, gpu=start["gpu"], world_size=int(start["world_size"]),
                          params_total=int(start["params_total"]), micro_batch_size=int(k["micro_batch_size"]),
                          grad_accum=int(k["gradient_accumulation_steps"]), seq_len=int(k["seq_len"]),
                          checkpointing=bool(k["gradient_checkpointing"]), zero_stage=int(k["zero_stage"]),
                          offload=offload, ep_size=int(k.get("ep_size") or 1),
                          tokens_per_s=_median(speeds), peak_allocated_bytes=int(max(peaks)),
                          records=len(used))


def _median(values: list[float]) -> float:
    """The median (not statistics.median: importing it would take a large share of fit's time budget)."""
    v = sorted(values)
    mid = len(v) // 2
    return float(v[mid]) if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def calibrate(req, m: RunMeasurement):
    """`req` planned with the run's measured utilisation and peak correction (a FitRequest in and out)."""
    from adaptive.plan.search.planner import evaluate, host_mem_for

    if req.gpu.name.rstrip("*") != m.gpu:
        raise AdaptiveError(f"run {m.run_dir!r} was measured on {m.gpu}, not {req.gpu.name}; plan for --gpu {m.gpu}")
    params = count_params(req.spec).total
    if params != m.params_total:
        raise AdaptiveError(f"run {m.run_dir!r} trained a model of {m.params_total:,} parameters, not this one "
                            f"({params:,}); calibrate with a run of the same model")
    per_node = min(m.world_size, 8)
    run_req = replace(req, gpus_per_node=per_node, num_nodes=max(1, m.world_size // per_node), peak_correction=1.0,
                      compute_scale=1.0, mfu=None, calibrated=())
    tokens = m.micro_batch_size * m.grad_accum * m.world_size * m.seq_len
    c = evaluate(run_req, req.spec, m.seq_len, m.micro_batch_size, m.zero_stage, m.offload, m.checkpointing,
                 m.ep_size, tokens, host_mem_for(run_req))
    t = c.throughput
    measured_step = tokens / m.tokens_per_s
    other = t.step_seconds - t.compute_seconds
    compute = measured_step - other
    if compute <= 0:
        raise AdaptiveError(f"run {m.run_dir!r}: measured step {measured_step:.3f} s is shorter than the modelled "
                            f"communication and offload ({other:.3f} s); cannot calibrate the compute time")
    scale = compute / t.compute_seconds
    factor = m.peak_allocated_bytes / c.memory.allocated_peak_bytes
    notes = (f"compute time x{scale:.3f} (measured: {m.tokens_per_s:,.0f} tokens/s over {m.records} records of "
             f"{m.run_dir}; hardware utilisation {t.utilisation / scale:.1%} where the model gave {t.utilisation:.1%})",
             f"peak memory x{factor:.3f} (measured {m.peak_allocated_bytes / 2**30:.2f} GiB allocated vs "
             f"{c.memory.allocated_peak_bytes / 2**30:.2f} GiB predicted at the run's knobs: ZeRO-{m.zero_stage}, "
             f"micro-batch {m.micro_batch_size}, seq {m.seq_len})")
    return replace(req, compute_scale=scale, peak_correction=factor,
                   calibrated=req.calibrated + notes)


__all__ = ["RunMeasurement", "parse_records", "corrected", "calibrate", "METRICS_FILE", "CALIBRATION_FILE"]
