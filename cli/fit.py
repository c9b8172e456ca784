"""`adaptive fit`: does this training run fit, with which DeepSpeed settings, how fast, at what cost."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from adaptive.plan import fit as plan_fit
from adaptive.plan import make_request
from adaptive.plan.emit import plan_dict, write_plan_files


class Offload(str, Enum):
    none = "none"
    optimizer = "optimizer"
    all = "all"


MODEL_HELP = "Preset (debug, debug_200m, b1, b7, b14, b30, b70) or a path to an HF config.json."
Model = Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP)]
Arch = Annotated[Optional[str], typer.Option(help="dense | moe | mod | hybrid (default: dense, or the config's).")]
Gpu = Annotated[Optional[str], typer.Option("--gpu", "-g", help="GPU name or alias; see `adaptive gpus`.")]
Gpus = Annotated[int, typer.Option("--gpus", help="GPUs per node.")]
Nodes = Annotated[int, typer.Option("--nodes", help="Number of nodes.")]
SeqLen = Annotated[int, typer.Option("--seq-len", help="Requested sequence length.")]
Mfu = Annotated[Optional[float], typer.Option("--mfu", help="Override the assumed MFU (0-1].")]
Price = Annotated[Optional[float], typer.Option("--price", help="USD per GPU hour (default: catalog price).")]
GpuMem = Annotated[Optional[float], typer.Option("--gpu-mem", help="Custom GPU memory in GiB.")]
GpuTflops = Annotated[Optional[float], typer.Option("--gpu-tflops", help="Custom GPU peak dense 16-bit TFLOP/s.")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]


def fit(
    model: Model = "b7",
    gpu: Gpu = None,
    arch: Arch = None,
    gpus: Gpus = 1,
    nodes: Nodes = 1,
    seq_len: SeqLen = 2048,
    min_seq_len: Annotated[Optional[int], typer.Option(help="Allow sequences down to this length if needed.")] = None,
    global_batch_tokens: Annotated[Optional[int], typer.Option(help="Global batch in tokens (default by size).")] = None,
    tokens: Annotated[Optional[float], typer.Option(help="Training tokens (default 20 x active params).")] = None,
    zero: Annotated[Optional[int], typer.Option(help="Pin the ZeRO stage (0-3).")] = None,
    offload: Annotated[Optional[Offload], typer.Option(help="Pin CPU offload.")] = None,
    micro_batch: Annotated[Optional[int], typer.Option(help="Pin the micro-batch per GPU.")] = None,
    grad_accum: Annotated[Optional[int], typer.Option(help="Pin gradient accumulation steps.")] = None,
    checkpointing: Annotated[Optional[bool], typer.Option("--checkpointing/--no-checkpointing",
                                                          help="Pin activation checkpointing.")] = None,
    ep_size: Annotated[Optional[int], typer.Option(help="Pin the expert-parallel size (MoE).")] = None,
    capacity_factor: Annotated[float, typer.Option(help="MoE capacity factor.")] = 1.0,
    mod_capacity: Annotated[Optional[float], typer.Option(help="MoD capacity (fraction of tokens routed).")] = None,
    mfu: Mfu = None,
    price: Price = None,
    host_mem: Annotated[Optional[float], typer.Option(help="Host RAM per node in GiB (default 3x GPU memory).")] = None,
    gpu_mem: GpuMem = None,
    gpu_tflops: GpuTflops = None,
    calibrate: Annotated[Optional[str], typer.Option(
        help="Plan with measured activations from `adaptive measure --save-calibration FILE`.")] = None,
    checkpoint_policy: Annotated[Optional[str], typer.Option(
        help="Pin activation checkpointing: off, selective (the planner picks mlp or every:N), full, or a "
             "policy: mlp (recompute each block's MLP half), every:N (every N-th block).")] = None,
    kernels: Annotated[Optional[str], typer.Option(
        help="lean (adaptive's memory-lean blocks) or plain (transformers' ops); default: lean, plain for "
             "a config.json that transformers' own class trains.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Write ds_config.json, accelerate_config.yaml, plan.json here.")] = None,
    json_output: Json = False,
) -> None:
    """Plan a DeepSpeed training run: ZeRO, offload, micro-batch, accumulation, checkpointing, cost."""
    request = make_request(
        model=model, gpu=gpu, arch=arch, gpus=gpus, nodes=nodes, seq_len=seq_len, min_seq_len=min_seq_len,
        global_batch_tokens=global_batch_tokens, tokens=tokens, zero=zero,
        offload=offload.value if offload else None, micro_batch=micro_batch, grad_accum=grad_accum,
        checkpointing=checkpointing, ep_size=ep_size, capacity_factor=capacity_factor,
        mod_capacity=mod_capacity, mfu=mfu, price=price, host_mem_gib=host_mem, gpu_mem_gib=gpu_mem,
        gpu_tflops=gpu_tflops, calibrate=calibrate, checkpoint_policy=checkpoint_policy, kernels=kernels)
    plan = plan_fit(request)
    files = write_plan_files(plan, out) if out else None
    if json_output:
        print(json.dumps(plan_dict(plan), indent=2))
    else:
        from cli import render  # rich costs ~40 ms to import; --json does not need it

        render.plan(plan, files)
    if not plan.fits:
        raise typer.Exit(1)
