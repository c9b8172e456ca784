"""Real training steps of planned configs on one GPU: measured memory, tokens/s and MFU vs the plan.

    python bench/gpu_check.py --out docs/gpu_check.md          # on a machine with one CUDA GPU
    python bench/gpu_check.py --dry-run                        # CPU: same code path, debug shapes

Configs: b1 dense, b1 MoE, b1 MoD, b1 hybrid (ZeRO-2), and b7 dense with ZeRO-2 + optimizer offload,
each at two micro-batches, sequence 2048, bf16, no checkpointing. For each: DeepSpeed is initialised
with the ds_config our emitter writes for that plan, 2 warm-up steps, then 3 timed steps.
Recorded: torch.cuda.max_memory_allocated / max_memory_reserved against the plan's predicted
allocated peak (without the CUDA-context and fragmentation allowances), tokens/s, and MFU (tokens/s x
the plan's model FLOPs per token / the GPU's peak). Finishes in a few minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

CONFIGS = [  # (preset, arch, zero, offload, micro-batches)
    ("b1", "dense", 2, "none", (2, 4)),
    ("b1", "moe", 2, "none", (1, 2)),
    ("b1", "mod", 2, "none", (2, 4)),
    ("b1", "hybrid", 2, "none", (1, 2)),
    ("b7", "dense", 2, "optimizer", (1, 2)),
]
GiB = 2**30


def init_single_process() -> None:
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed()


def run_config(preset: str, arch: str, zero: int, offload: str, micro: int, gpu: str, dry_run: bool,
               warmup: int, steps: int) -> dict:
    import deepspeed
    import torch

    from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM
    from adaptive.plan import fit, make_request
    from adaptive.plan.emit import ds_config
    from adaptive.plan.throughput import model_flops_per_token

    seq = 128 if dry_run else 2048
    model_name = "debug" if dry_run else preset
    plan = fit(make_request(model=model_name, arch=arch, gpu=gpu, seq_len=seq, micro_batch=micro, grad_accum=1,
                            zero=zero, offload=offload, checkpointing=False), suggest=False)
    setup = plan.shown.setup
    cfg = ds_config(setup, 1, plan.request.gpu)
    device = "cpu" if dry_run else "cuda"
    if dry_run:  # the CPU has no bf16 DeepSpeed kernels worth timing and no compiled CPU Adam here
        cfg.pop("bf16", None)
        cfg["zero_optimization"].pop("offload_optimizer", None)
    overrides = {"moe_implementation": "deepspeed"} if arch in ("moe", "hybrid") else {}
    config = AdaptiveConfig.from_preset(model_name, arch=arch, **overrides)
    torch.manual_seed(0)
    with torch.device(device):
        model = AdaptiveForCausalLM(config).to(torch.float32 if dry_run else torch.bfloat16)
    model.train()
    if offload == "optimizer" and not dry_run:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                                      fused=not dry_run)
    if arch in ("moe", "hybrid"):
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "params"})
        optimizer = type(optimizer)(groups, lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    ids = torch.randint(0, config.vocab_size, (micro, seq), device=device)
    if not dry_run:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    if not dry_run:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    if not dry_run:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens_per_s = steps * micro * seq / elapsed
    measured = torch.cuda.max_memory_allocated() if not dry_run else None
    reserved = torch.cuda.max_memory_reserved() if not dry_run else None
    predicted = plan.shown.memory.allocated_peak_bytes
    flops = model_flops_per_token(setup.spec, seq)
    row = {
        "model": preset, "arch": arch, "zero": zero, "offload": offload, "micro_batch": micro, "seq_len": seq,
        "predicted_allocated_bytes": predicted, "max_memory_allocated": measured, "max_memory_reserved": reserved,
        "memory_error": (predicted / measured - 1) if measured else None,
        "tokens_per_s": tokens_per_s, "predicted_tokens_per_s": plan.shown.throughput.tokens_per_second,
        "mfu": tokens_per_s * flops / (plan.request.gpu.peak_tflops * 1e12),
        "mfu_assumed": plan.shown.throughput.utilisation,
    }
    del engine, model, optimizer
    if not dry_run:
        torch.cuda.empty_cache()
    return row


def table(rows: list[dict], gpu: str) -> str:
    out = [f"GPU: {gpu}. Memory: plan's allocated peak (no allowances) vs torch.cuda.max_memory_allocated.",
           "", "| model | arch | ZeRO / offload | mb | predicted GiB | max allocated GiB | error | max reserved GiB "
           "| tokens/s | predicted tokens/s | MFU measured | MFU assumed |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        alloc = f"{r['max_memory_allocated'] / GiB:.2f}" if r["max_memory_allocated"] else "-"
        res = f"{r['max_memory_reserved'] / GiB:.2f}" if r["max_memory_reserved"] else "-"
        err = f"{r['memory_error']:+.1%}" if r["memory_error"] is not None else "-"
        out.append(f"| {r['model']} | {r['arch']} | {r['zero']} / {r['offload']} | {r['micro_batch']} | "
                   f"{r['predicted_allocated_bytes'] / GiB:.2f} | {alloc} | {err} | {res} | {r['tokens_per_s']:,.0f} | "
                   f"{r['predicted_tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['mfu_assumed']:.0%} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, debug shapes, one step: checks the code path")
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--json", help="write the rows as JSON here")
    ap.add_argument("--only", help="comma-separated preset_arch names to run, e.g. b1_dense,b7_dense")
    args = ap.parse_args()
    import torch

    from adaptive.plan.gpus import match_detected_gpu

    if args.dry_run:
        gpu, warmup, steps = "a100-80gb", 0, 1
    else:
        props = torch.cuda.get_device_properties(0)
        found = match_detected_gpu(props.name, props.total_memory)
        gpu, warmup, steps = (found.name if found else "h200-141gb"), 2, 3
    init_single_process()
    rows = []
    for preset, arch, zero, offload, micros in CONFIGS:
        if args.only and f"{preset}_{arch}" not in args.only.split(","):
            continue
        for micro in micros[:1] if args.dry_run else micros:
            row = run_config(preset, arch, zero, offload, micro, gpu, args.dry_run, warmup, steps)
            rows.append(row)
            print(json.dumps(row), flush=True)
    text = table(rows, gpu if not args.dry_run else "none (dry run on the CPU)")
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
