"""`adaptive measure`: run the real model's training step on fake tensors and compare with the plan."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from adaptive.plan import make_request
from cli.fit import Arch, Gpu, GpuMem, GpuTflops, Json, Model, SeqLen


def measure(
    model: Model = "b7",
    gpu: Gpu = None,
    arch: Arch = None,
    seq_len: SeqLen = 2048,
    micro_batch: Annotated[int, typer.Option(help="Micro-batch per GPU.")] = 1,
    checkpointing: Annotated[bool, typer.Option("--checkpointing/--no-checkpointing",
                                                help="Full activation checkpointing.")] = False,
    zero: Annotated[int, typer.Option(help="ZeRO stage whose one-GPU state layout is emulated (0-3).")] = 0,
    capacity_factor: Annotated[float, typer.Option(help="MoE capacity factor.")] = 1.0,
    mod_capacity: Annotated[Optional[float], typer.Option(help="MoD capacity (fraction of tokens routed).")] = None,
    full_depth: Annotated[bool, typer.Option("--full-depth",
                                             help="Build every layer instead of extrapolating from 2 depths.")] = False,
    save_calibration: Annotated[Optional[str], typer.Option(
        help="Also measure with and without checkpointing and write a calibration file for `fit --calibrate`.")] = None,
    gpu_mem: GpuMem = None,
    gpu_tflops: GpuTflops = None,
    json_output: Json = False,
) -> None:
    """Measure memory of a real training step with fake tensors (no memory, no GPU), next to the plan."""
    from adaptive.plan.planner import validate

    request = make_request(model=model, gpu=gpu or ("a100-80gb" if gpu_mem is None else None), arch=arch,
                           seq_len=seq_len, micro_batch=micro_batch, capacity_factor=capacity_factor,
                           mod_capacity=mod_capacity, zero=zero, gpu_mem_gib=gpu_mem, gpu_tflops=gpu_tflops)
    validate(request)  # the ZeRO stage too: 0-3, and not 3 for MoE
    if save_calibration:  # before minutes of measuring, not after
        from adaptive.fidelity.calibrate import check_writable

        check_writable(save_calibration)
    from adaptive.fidelity.compare import compare, report_dict  # torch: only now

    report = compare(request, model, zero_stage=zero, micro_batch=micro_batch, checkpointing=checkpointing,
                     full_depth=full_depth)
    files = {}
    if save_calibration:
        from adaptive.fidelity.calibrate import write_calibration

        files["calibration"] = write_calibration(request, model, save_calibration, micro_batch=micro_batch)
    if json_output:
        print(json.dumps({**report_dict(report), **{k: str(v) for k, v in files.items()}}, indent=2))
        return
    from cli.render import measure_report

    measure_report(report, files)
