"""Overhead of the orchestrator on the debug MoE recipe's training step, on and off interleaved in one run.

    PYTHONPATH=. python bench/bench_orchestrator.py                  # seq 128, 256, 512
    PYTHONPATH=. python bench/bench_orchestrator.py --quick          # smoke run

The run is built as `recipes/debug_moe.py` builds it on a CPU (the planner, accelerate's DeepSpeed
engine, ZeRO-0 for one process, DeepSpeed MoE with our gate, the shipped corpus and tokenizer,
micro-batch 4), then the loop's own step is driven: on_step_start, `run_step` (forward, backward and
the optimizer step over the micro-batches, with the loop's per-step skip check), the commit, the
metrics interval (a record every 10 steps, as --log-every 10), on_step_end and the request agreement.
The same engine takes turns: one step without callbacks, one with every policy (monitor, balance,
capacity, oom, guard, ep and the event log), in ABBA order so log steps fall on both sides.

Prints, per sequence length:
- the median step time on and off and their ratio (target: under 1% extra), and the ratio with the
  time spent in the callbacks taken out of each "on" step (what is left is noise, or an indirect cost);
- the time spent inside the orchestrator's callbacks per step (perf_counter around each event), as a
  fraction of the median step: the same overhead without the step-to-step noise of a shared machine;
- extra memory (target: under 50 MB): VmRSS after 40 steps with the policies minus before they were built,
  beside the drift of 40 steps without them; the same for Python's heap (tracemalloc, during that phase
  only); and the bytes of the tensors the policies hold.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from adaptive.orchestrator import policies  # noqa: E402
from adaptive.train.run.callbacks import CallbackList, Control, TrainerState  # noqa: E402


def rss_bytes() -> int:
    """VmRSS after a garbage collection and glibc's malloc_trim (freed heap returned to the OS: less noise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class TimedCallbacks(CallbackList):
    """Adds up the wall time spent in the callbacks' events."""

    def __init__(self, callbacks):
        super().__init__(callbacks)
        self.seconds = 0.0

    def _call(self, event, state, control, **kwargs):
        started = time.perf_counter()
        super()._call(event, state, control, **kwargs)
        self.seconds += time.perf_counter() - started


def policy_tensor_bytes(chain: list) -> int:
    """Bytes of the tensors the policies keep between steps (accumulators, bias masters)."""
    total = 0
    for cb in chain:
        for value in vars(cb).values():
            tensors = value if isinstance(value, list) else [value]
            for t in tensors:
                if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                    if getattr(cb, "biases", None) is not None and any(t is b for b in cb.biases):
                        continue  # the model's own buffers
                    total += t.numel() * t.element_size()
    return total


def build(seq_len: int, out: Path):
    """The debug MoE recipe's run on this CPU, as adaptive.train.run.entry.run builds it."""
    from adaptive.train.run import setup
    from adaptive.config.commandline import parse
    from adaptive.train.run.loop import Loop, LoopSettings
    from adaptive.train.reporting.metrics import MetricsWriter
    from adaptive.train.run.runplan import World, detect_device, plan_run

    config = parse("train", ["--seq-len", str(seq_len), "--micro-batch", "4", "--grad-accum", "1",
                             "--max-steps", "100000", "--output-dir", str(out), "--orchestrator", "on",
                             "--dataset", "builtin", "--no-progress"])
    setup.init_distributed()
    plan = plan_run(config, "debug", "moe", World(1, 1), detect_device(None))
    accelerator = setup.make_accelerator(plan)
    setup.quiet_libraries(True)
    opt = config.optimizer
    data = setup.load_data(config.data, opt.seed, plan, accelerator, plan.plan.request.spec.vocab_size)
    model = setup.build_model(plan, data.tokenizer, opt.seed)
    optimizer = setup.build_optimizer(model, plan.knobs, setup.peak_lr(opt.lr, "debug"), opt.weight_decay)
    lr_scheduler = setup.build_scheduler(optimizer, 10, plan.max_steps)
    engine, optimizer, scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    out.mkdir(parents=True, exist_ok=True)
    state = TrainerState(max_steps=plan.max_steps, knobs=plan.knobs, output_dir=out, plan=plan.plan, orchestrator=True,
                         accelerator=accelerator, model=engine, optimizer=optimizer, scheduler=scheduler, world_size=1)
    loop = Loop(run=plan, data=data, callbacks=CallbackList([]), metrics=MetricsWriter(out, False),
                settings=LoopSettings(log_every=10, checkpoint_every=0, progress=False), device=accelerator.device,
                lr_scheduler=lr_scheduler)
    return state, loop


def one_step(state, control, loop, samples, meter, chain) -> float:
    """The training loop's own step (adaptive.train.run.loop.step_once) with `chain` as its callbacks."""
    from adaptive.train.run.loop import step_once

    loop.callbacks = chain
    started = time.perf_counter()
    step_once(state, control, loop, samples, meter)
    return time.perf_counter() - started


def measure(seq_len: int, steps: int, warmup: int, memory_steps: int = 40) -> dict:
    from adaptive.train.data.batches import SampleIterator
    from adaptive.train.reporting.metrics import IntervalMeter

    with tempfile.TemporaryDirectory() as tmp:
        state, loop = build(seq_len, Path(tmp) / "run")
        control = Control()
        samples = SampleIterator(loop.data.train, 0)
        meter = IntervalMeter(loop.device)
        off = TimedCallbacks([])
        state.model.train()
        for _ in range(warmup):
            one_step(state, control, loop, samples, meter, off)
        # memory: an off-only phase (the loop's own drift), then as many steps with the policies built and
        # running (their imports, accumulators and event log included); VmRSS, and Python's heap by tracemalloc
        gc.collect()
        tracemalloc.start()
        rss_start, heap_start = rss_bytes(), tracemalloc.get_traced_memory()[0]
        for _ in range(memory_steps):
            one_step(state, control, loop, samples, meter, off)
        gc.collect()
        rss_before, heap_before = rss_bytes(), tracemalloc.get_traced_memory()[0]
        chain = policies()
        on = TimedCallbacks(chain)
        on.on_train_start(state, control)
        for _ in range(memory_steps):
            one_step(state, control, loop, samples, meter, on)
        gc.collect()
        rss_after, heap_after = rss_bytes(), tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        on.seconds = 0.0
        times = {"off": [], "on": [], "on_without_callbacks": []}
        for i in range(steps):
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            for side in order:
                chain_for_side = on if side == "on" else off
                before = chain_for_side.seconds
                seconds = one_step(state, control, loop, samples, meter, chain_for_side)
                times[side].append(seconds)
                if side == "on":
                    times["on_without_callbacks"].append(seconds - (on.seconds - before))
        on.on_train_end(state, control)
        med_off, med_on = statistics.median(times["off"]), statistics.median(times["on"])
        return {"seq_len": seq_len, "steps": steps, "median_off_ms": 1e3 * med_off, "median_on_ms": 1e3 * med_on,
                "ratio": med_on / med_off,
                "ratio_without_callbacks": statistics.median(times["on_without_callbacks"]) / med_off,
                "callback_ms_per_step": 1e3 * on.seconds / steps,
                "callback_fraction": on.seconds / steps / med_off, "rss_delta_mb": (rss_after - rss_before) / 2**20,
                "rss_drift_off_mb": (rss_before - rss_start) / 2**20,
                "heap_delta_kb": (heap_after - heap_before) / 1024,
                "heap_drift_off_kb": (heap_before - heap_start) / 1024,
                "tensor_bytes": policy_tensor_bytes(chain), "decisions": len(chain[-1].events.decisions)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: steadier "
                        "timings on a shared machine)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: measure one length, print JSON
    ns = parser.parse_args()
    if ns.quick:
        ns.seq_lens, ns.steps, ns.warmup = [128], 20, 3
    torch.set_num_threads(ns.threads)
    if ns.one is not None:
        import logging

        logging.disable(logging.WARNING)
        print("RESULT " + json.dumps(measure(ns.one, ns.steps, ns.warmup)))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")
    print("| seq | off ms (median) | on ms (median) | on/off | on/off, callbacks' time taken out "
          "| in callbacks, ms/step | callbacks / step "
          "| RSS delta on (off-only drift) | Python heap delta on (off-only drift) | policy tensors |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for seq in ns.seq_lens:  # one process each: accelerate's state is a per-process singleton
        done = subprocess.run([sys.executable, __file__, "--one", str(seq), "--steps", str(ns.steps), "--warmup",
                               str(ns.warmup), "--threads", str(ns.threads)], capture_output=True, text=True, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            raise SystemExit(f"seq {seq} failed:\n{done.stderr[-3000:]}")
        r = json.loads(lines[-1][len("RESULT "):])
        print(f"| {seq} | {r['median_off_ms']:.1f} | {r['median_on_ms']:.1f} | {r['ratio']:.4f} | "
              f"{r['ratio_without_callbacks']:.4f} | "
              f"{r['callback_ms_per_step']:.3f} | {100 * r['callback_fraction']:.2f}% | "
              f"{r['rss_delta_mb']:.1f} MB ({r['rss_drift_off_mb']:.1f} MB) | "
              f"{r['heap_delta_kb']:.0f} KiB ({r['heap_drift_off_kb']:.0f} KiB) | "
              f"{r['tensor_bytes']} B |", flush=True)


if __name__ == "__main__":
    main()
