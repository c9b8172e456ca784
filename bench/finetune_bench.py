"""LoRA vs full fine-tuning, and QLoRA vs LoRA, on this machine at one shape: median step time and peak resident memory.

    PYTHONPATH=. python bench/finetune_bench.py                  # hidden 512, 6 layers, seq 256, 3 rounds
    PYTHONPATH=. python bench/finetune_bench.py --quick          # smoke run (tiny shape, 1 round)
    PYTHONPATH=. python bench/finetune_bench.py --json OUT.json  # the per-run figures too

One tiny-but-not-trivial Llama (transformers' LlamaForCausalLM, vocab 2048: the shipped offline tokenizer; seeded, saved
in fp32 with save_pretrained) is fine-tuned by recipes/finetune.py's own code (`Recipe(finetune=...).main`: the planner,
accelerate's DeepSpeed engine at ZeRO-0 for one process, PEFT LoRA r=16 on every linear, bitsandbytes NF4 for QLoRA,
torch AdamW) on 2048 chat rows packed into blocks of the sequence length, micro-batch 4, no checkpointing. Each method
runs in its own process, `--rounds` times, the methods interleaved in a rotating order (full, lora, qlora; lora,
qlora, full; ...), since the machine is shared and noisy.

Per run, a callback measures each optimizer step (perf_counter from on_step_start to on_step_end: forward, backward
and optimizer step of its micro-batches) and reads /proc/self/status at the last step's end: VmHWM, the process's
peak resident memory so far (loading, preparing and training; nothing after), and VmRSS. The process then exits at
once: the final checkpoint, eval and export are not measured. Steps 1-`--warmup` are left out of the median.

Prints, per method, the median over rounds of each run's median step time (and the round medians, and the load
average at each run's start) and the median peak RSS over rounds; then the ratios LoRA/full and QLoRA/LoRA, of those
medians and paired within each round.
What the numbers are on a CPU: docs/BENCHMARKS.md, "Fine-tuning on the CPU: LoRA vs full, QLoRA vs LoRA".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHODS = ("full", "lora", "qlora")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' }}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] + eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def write_inputs(folder: Path, hidden: int, layers: int, rows: int) -> tuple[Path, Path]:
    """The checkpoint (intermediate 8/3 hidden rounded to 64, heads of 64, half as many KV heads) and chat rows."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from adaptive.train.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    tokenizer.chat_template = CHAT_TEMPLATE
    heads = max(2, hidden // 64)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=(8 * hidden // 3 + 63) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                         head_dim=hidden // heads, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    checkpoint = folder / "llama"
    LlamaForCausalLM(config).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    data = folder / "chat.jsonl"
    with open(data, "w", encoding="utf-8") as f:
        for i in range(rows):
            a, b = i % 97, (i * 7) % 89
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} plus {b}? Answer in words."},
                                             {"role": "assistant", "content": f"{a} plus {b} is {a + b}, since "
                                                                              f"{a + b} minus {b} is {a}."}]}) + "\n")
    return checkpoint, data


# --- one run (a child process) ---------------------------------------------------------------------------------------

def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def child(method: str, checkpoint: str, data: str, seq: int, steps: int, out: str) -> None:
    from adaptive.recipe import Recipe
    from adaptive.train.run.callbacks import Callback

    class Probe(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.started = 0.0
            self.after_prepare: dict[str, int] = {}

        def on_train_start(self, state, control):
            self.after_prepare = _status()
            self.trainable = sum(p.numel() for p in state.model.module.parameters() if p.requires_grad)

        def on_step_start(self, state, control):
            self.started = time.perf_counter()

        def on_step_end(self, state, control, *, metrics):
            self.times.append(time.perf_counter() - self.started)
            if state.step == state.max_steps:
                import torch

                result = {"method": method, "step_s": self.times, "end": _status(), "after_prepare":
                          self.after_prepare, "trainable_params": self.trainable, "threads": torch.get_num_threads(),
                          "knobs": state.knobs.as_dict()}
                Path(out).write_text(json.dumps(result))
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)  # the checkpoint, eval and export after the last step are not measured

    with tempfile.TemporaryDirectory() as run_dir:
        flags = ["--init-from", checkpoint, "--finetune", method, "--dataset", data, "--packing", "--seq-len", str(seq),
                 "--micro-batch", "4", "--grad-accum", "1", "--max-steps", str(steps),
                 *(["--lora-rank", "16"] if method != "full" else []),
                 "--no-checkpointing", "--checkpoint-every", str(10 * steps), "--eval-every", str(10 * steps),
                 "--log-every", str(steps), "--orchestrator", "off", "--no-progress", "--output-dir", run_dir]
        Recipe(finetune=method).main(flags, callbacks=[Probe()])
    raise SystemExit(f"{method}: the run ended without reaching its last step")


# --- the comparison --------------------------------------------------------------------------------------------------

def run_one(method: str, checkpoint: Path, data: Path, seq: int, steps: int, work: Path, index: int) -> dict:
    out = work / f"{index:02d}_{method}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "ADAPTIVE_CACHE": str(work / "cache"), "HF_HOME": str(work / "hf")}
    env.pop("RANK", None)
    started, load = time.monotonic(), os.getloadavg()[0]
    done = subprocess.run([sys.executable, __file__, "--child", method, "--checkpoint", str(checkpoint), "--data",
                           str(data), "--seq-len", str(seq), "--steps", str(steps), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"{method} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    result = json.loads(out.read_text())
    result["wall_s"], result["load_at_start"], result["round"] = time.monotonic() - started, load, index // len(METHODS)
    return result


def summarize(results: list[dict], warmup: int) -> dict[str, dict]:
    """Per method: the median over rounds of each round's median step (a disturbed round moves it less than it
    moves the median of all steps), the round medians, the peak RSS (median over rounds)."""
    out = {}
    for method in METHODS:
        runs = [r for r in results if r["method"] == method]
        if not runs:
            continue
        steps = [t for r in runs for t in r["step_s"][warmup:]]
        out[method] = {
            "step_s": statistics.median(statistics.median(r["step_s"][warmup:]) for r in runs),
            "all_steps_median_s": statistics.median(steps),
            "round_step_s": [statistics.median(r["step_s"][warmup:]) for r in runs],
            "peak_rss": statistics.median(r["end"]["VmHWM"] for r in runs),
            "round_peak_rss": [r["end"]["VmHWM"] for r in runs],
            "rss_after_prepare": statistics.median(r["after_prepare"]["VmRSS"] for r in runs),
            "trainable_params": runs[0]["trainable_params"], "threads": runs[0]["threads"],
            "measured_steps": len(steps),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=14, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the median")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--quick", action="store_true", help="tiny shape, 1 round: a smoke run")
    parser.add_argument("--json", help="write the summary and every run's figures here")
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.checkpoint, args.data, args.seq_len, args.steps, args.out)
        return
    if args.quick:
        args.hidden, args.layers, args.seq_len, args.steps, args.rounds, args.rows = 128, 2, 64, 4, 1, 256
    sys.path.insert(0, str(REPO))
    results = []
    with tempfile.TemporaryDirectory(prefix="finetune_bench_") as tmp:
        work = Path(tmp)
        checkpoint, data = write_inputs(work, args.hidden, args.layers, args.rows)
        for round_ in range(args.rounds):
            order = METHODS[round_ % 3:] + METHODS[:round_ % 3]
            for method in order:
                result = run_one(method, checkpoint, data, args.seq_len, args.steps, work, len(results))
                results.append(result)
                print(f"round {round_ + 1} {method:5s}: median step {statistics.median(result['step_s'][args.warmup:]):.3f} s, "
                      f"peak RSS {result['end']['VmHWM'] / 2**20:,.0f} MiB ({result['wall_s']:.0f} s, load average "
                      f"{result['load_at_start']:.1f} at its start)", flush=True)
    summary = summarize(results, args.warmup)
    print(f"\nLlama hidden {args.hidden}, {args.layers} layers, vocab 2048, seq {args.seq_len}, micro-batch 4, fp32 "
          f"(QLoRA: NF4 base, bf16 compute), {args.rounds} round(s) x {args.steps} steps ({args.warmup} warm-up), "
          f"{summary['full']['threads'] if 'full' in summary else '?'} threads")
    print(f"{'method':8s} {'trainable':>12s} {'median step':>12s} {'round medians':>24s} {'peak RSS':>10s} "
          f"{'RSS after prepare':>18s}")
    for method, s in summary.items():
        rounds = ", ".join(f"{t:.3f}" for t in s["round_step_s"])
        print(f"{method:8s} {s['trainable_params']:>12,} {s['step_s']:>10.3f} s {rounds:>24s} "
              f"{s['peak_rss'] / 2**20:>6,.0f} MiB {s['rss_after_prepare'] / 2**20:>14,.0f} MiB")
    ratios = {}
    for a, b in (("lora", "full"), ("qlora", "lora")):
        if a in summary and b in summary:
            # paired: each round's two runs ran minutes apart, under the same load more often than runs of other rounds
            paired = [summary[a]["round_step_s"][i] / summary[b]["round_step_s"][i]
                      for i in range(min(len(summary[a]["round_step_s"]), len(summary[b]["round_step_s"])))]
            ratios[f"{a}/{b}"] = {"step_time": summary[a]["step_s"] / summary[b]["step_s"],
                                  "step_time_paired": statistics.median(paired), "paired": paired,
                                  "peak_rss": summary[a]["peak_rss"] / summary[b]["peak_rss"]}
            r = ratios[f"{a}/{b}"]
            print(f"{a.upper()}/{b.upper() if b != 'full' else 'full'}: step time x{r['step_time']:.2f} (per round: "
                  f"{', '.join(f'{x:.2f}' for x in paired)}; their median x{r['step_time_paired']:.2f}), "
                  f"peak RSS x{r['peak_rss']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary, "ratios": ratios,
                                               "runs": results}, indent=1))


if __name__ == "__main__":
    main()
