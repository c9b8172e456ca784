"""`adaptive measure`: run the real model's training step on fake tensors and compare with the plan."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from adaptive.plan import make_request
from adaptive.config.commandline import with_run_options
from adaptive.config.run import MEASURE, RunConfig
from adaptive.extras import require
from cli.fit import Json


@with_run_options(MEASURE)
def measure(
    config: RunConfig,
    full_depth: Annotated[bool, typer.Option("--full-depth",
                                             help="Build every layer instead of extrapolating from 2 depths.")] = False,
    save_calibration: Annotated[Optional[str], typer.Option(
        help="Also measure with and without checkpointing and write a calibration file for `fit --calibrate`.")] = None,
    json_output: Json = False,
) -> None:
    """Measure memory of a real training step with fake tensors (no memory, no GPU), next to the plan."""
    require("adaptive measure")  # before minutes of work and before torch: one line in a planner-only install
    from adaptive.plan.search.planner import validate

    # what is measured: the pinned knobs, else one sequence on ZeRO-0 without checkpointing
    model = config.model.name or "b7"
    zero = config.parallelism.zero or 0
    micro_batch = config.parallelism.micro_batch or 1
    checkpointing = config.checkpointing.checkpoint_policy or bool(config.checkpointing.gradient_checkpointing)
    hw = config.hardware
    request = make_request(model=model, gpu=hw.gpu or ("a100-80gb" if hw.gpu_mem is None else None),
                           arch=config.model.arch, seq_len=config.data.seq_len or 2048, micro_batch=micro_batch,
                           capacity_factor=config.model.capacity_factor, mod_capacity=config.model.mod_capacity,
                           zero=zero, gpu_mem_gib=hw.gpu_mem, gpu_tflops=hw.gpu_tflops, kernels=config.model.kernels,
                           finetune=(ft := config.finetune).finetune, lora_rank=ft.lora_rank, lora_alpha=ft.lora_alpha,
                           lora_targets=ft.lora_targets, lora_dropout=ft.lora_dropout)
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
