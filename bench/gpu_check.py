"""Real training steps of planned configs on one GPU: measured memory, tokens/s and MFU vs the plan.

    python bench/gpu_check.py --out docs/gpu_check.md          # on a machine with one CUDA GPU
    python bench/gpu_check.py --dry-run                        # CPU: same code path, debug shapes

Configs: b1 dense, b1 MoE, b1 MoD, b1 hybrid (ZeRO-2), and b7 dense with ZeRO-2 + optimizer offload,
each at two micro-batches, sequence 2048, bf16, no checkpointing. For each config: DeepSpeed is
initialised once with the ds_config our emitter writes for its plan; each micro-batch then runs 2
warm-up steps and 3 timed steps on that engine, with the peak statistics reset in between. Under
offload the optimizer is DeepSpeedCPUAdam (JIT-built on first use: needs ninja and a C++ compiler),
or torch AdamW on the CPU if that build fails; the row says which. The offload config is skipped,
with the reason in its row, when host RAM cannot hold its 16 bytes per parameter. The table is
rewritten after each config, so a crash keeps the rows before it. The dry run (debug shapes, CPU,
both micro-batches, offload through torch AdamW) runs in the suite.
Recorded: torch.cuda.max_memory_allocated / max_memory_reserved against the plan's predicted
allocated peak (without the CUDA-context and fragmentation allowances), tokens/s, and MFU (tokens/s x
the plan's model FLOPs per token / the GPU's peak). Its expected run time on an H200 is in
docs/BENCHMARKS.md. b7 offload keeps ~108 GiB (16 bytes x 7.24e9 params) in host RAM: it needs a host with more than that.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, as the other benches do

from adaptive.plan.architecture.blocks import block_type  # noqa: E402

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


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def make_optimizer(model, arch: str, offload: str, dry_run: bool, cfg: dict):
    """(optimizer, its name). Under optimizer offload DeepSpeedCPUAdam, whose C++ extension DeepSpeed
    JIT-builds on first use (ninja and a C++ compiler); if that build fails, torch AdamW on
    the CPU with DeepSpeed's guard against client optimizers lifted (slower steps, same memory)."""
    import torch

    params = list(model.parameters())
    if block_type(arch).has_experts:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        params = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "params"})
    kw = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    if offload == "optimizer":
        if not dry_run:
            try:
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(params, **kw), "DeepSpeedCPUAdam"
            except Exception as e:  # the JIT build: no compiler, no ninja, no CUDA headers
                reason = " ".join(str(e).split())[:200]
                print(f"DeepSpeedCPUAdam unavailable ({type(e).__name__}: {reason}); using torch AdamW on the CPU",
                      file=sys.stderr, flush=True)
        cfg["zero_force_ds_cpu_optimizer"] = False
        return torch.optim.AdamW(params, **kw), "torch AdamW (CPU)"
    return torch.optim.AdamW(params, fused=not dry_run, **kw), "torch AdamW (fused)" if not dry_run else "torch AdamW"


def run_config(preset: str, arch: str, zero: int, offload: str, micros: tuple[int, ...], gpu: str, dry_run: bool,
               warmup: int, steps: int) -> list[dict]:
    """One DeepSpeed engine for the config; each micro-batch measured on it (peak statistics reset)."""
    import deepspeed
    import torch

    from adaptive.models import AdaptiveConfig, AdaptiveForCausalLM
    from adaptive.plan import fit, make_request
    from adaptive.plan.ds_config.emit import ds_config
    from adaptive.plan.estimate.throughput import model_flops_per_token

    seq = 128 if dry_run else 2048
    model_name = "debug" if dry_run else preset
    plans = [fit(make_request(model=model_name, arch=arch, gpu=gpu, seq_len=seq, micro_batch=micro, grad_accum=1,
                              zero=zero, offload=offload, checkpointing=False), suggest=False) for micro in micros]
    base = {"model": preset, "arch": arch, "zero": zero, "offload": offload, "seq_len": seq}
    if offload != "none" and not dry_run:
        # fp32 master weights, fp32 gradients and two Adam moments live in host RAM: 16 bytes a parameter
        need = 16 * plans[0].counts.total
        have = host_available_bytes()
        if have is not None and need > 0.95 * have:
            note = f"skipped: offload needs ~{need / GiB:.0f} GiB host RAM, {have / GiB:.0f} GiB available"
            print(note, file=sys.stderr, flush=True)
            return [dict(base, micro_batch=m, skipped=note) for m in micros]
    setup = plans[0].shown.setup
    cfg = ds_config(setup, 1, plans[0].request.gpu)
    device = "cpu" if dry_run else "cuda"
    if dry_run:  # the CPU has no bf16 DeepSpeed kernels worth timing
        cfg.pop("bf16", None)
    overrides = {"moe_implementation": "deepspeed"} if block_type(arch).has_experts else {}
    config = AdaptiveConfig.from_preset(model_name, arch=arch, **overrides)
    torch.manual_seed(0)
    with torch.device(device):
        model = AdaptiveForCausalLM(config).to(torch.float32 if dry_run else torch.bfloat16)
    model.train()
    optimizer, optimizer_name = make_optimizer(model, arch, offload, dry_run, cfg)
    if optimizer_name == "torch AdamW (CPU)" and not dry_run:
        warmup, steps = 1, 2  # CPU AdamW on b7 is slow: fewer steps keep the check inside one device lease
    start = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    init_s = time.perf_counter() - start
    rows = []
    for micro, plan in zip(micros, plans):
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
        flops = model_flops_per_token(plan.shown.setup.spec, seq)
        rows.append(dict(
            base, micro_batch=micro, optimizer=optimizer_name, deepspeed_init_s=init_s, timed_steps=steps,
            predicted_allocated_bytes=predicted, max_memory_allocated=measured, max_memory_reserved=reserved,
            memory_error=(predicted / measured - 1) if measured else None,
            tokens_per_s=tokens_per_s, predicted_tokens_per_s=plan.shown.throughput.tokens_per_second,
            mfu=tokens_per_s * flops / (plan.request.gpu.peak_tflops * 1e12),
            mfu_assumed=plan.shown.throughput.utilisation,
        ))
        del ids
    engine.destroy()
    del engine, model, optimizer
    gc.collect()  # DeepSpeed's engine holds reference cycles; free its GPU and pinned host memory now
    if not dry_run:
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], gpu: str) -> str:
    out = [f"GPU: {gpu}. Memory: plan's allocated peak (no allowances) vs torch.cuda.max_memory_allocated.",
           "", "| model | arch | ZeRO / offload | mb | predicted GiB | max allocated GiB | error | max reserved GiB "
           "| tokens/s | predicted tokens/s | MFU measured | MFU assumed | optimizer |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['model']} | {r['arch']} | {r['zero']} / {r['offload']} | {r['micro_batch']} | "
        if "skipped" in r:
            out.append(head + f"{r['skipped']} |" + " |" * 8)
            continue
        alloc = f"{r['max_memory_allocated'] / GiB:.2f}" if r["max_memory_allocated"] else "-"
        res = f"{r['max_memory_reserved'] / GiB:.2f}" if r["max_memory_reserved"] else "-"
        err = f"{r['memory_error']:+.1%}" if r["memory_error"] is not None else "-"
        out.append(head + f"{r['predicted_allocated_bytes'] / GiB:.2f} | {alloc} | {err} | {res} | "
                   f"{r['tokens_per_s']:,.0f} | {r['predicted_tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
                   f"{r['mfu_assumed']:.0%} | {r['optimizer']} |")
    return "\n".join(out) + "\n"


def write(rows: list[dict], gpu: str, args) -> str:
    """The table (and JSON) so far: a config that crashes the process later loses only itself."""
    text = table(rows, gpu)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, debug shapes, one step: checks the code path")
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--json", help="write the rows as JSON here")
    ap.add_argument("--only", help="comma-separated preset_arch names to run, e.g. b1_dense,b7_dense")
    args = ap.parse_args()
    import torch

    from adaptive.plan.hardware.gpus import match_detected_gpu

    if args.dry_run:
        gpu, warmup, steps = "a100-80gb", 0, 1
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_check: no CUDA GPU visible to torch (torch.cuda.is_available() is False); "
                     "run it on a machine with one, or use --dry-run on the CPU")
        props = torch.cuda.get_device_properties(0)
        found = match_detected_gpu(props.name, props.total_memory)
        if found is None:
            sys.exit(f"gpu_check: {props.name!r} ({props.total_memory / GiB:.0f} GiB) is not in the GPU catalog "
                     "(`adaptive gpus`); its peak TFLOP/s is needed for MFU")
        gpu, warmup, steps = found.name, 2, 3
    init_single_process()
    rows = []
    label = gpu if not args.dry_run else "none (dry run on the CPU)"
    start = time.perf_counter()
    for preset, arch, zero, offload, micros in CONFIGS:
        if args.only and f"{preset}_{arch}" not in args.only.split(","):
            continue
        for row in run_config(preset, arch, zero, offload, micros, gpu, args.dry_run, warmup, steps):
            rows.append(row)
            print(json.dumps(row), flush=True)
        write(rows, label, args)
    print(write(rows, label, args))
    print(f"total {time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
