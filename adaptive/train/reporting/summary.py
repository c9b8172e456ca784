"""What a run says about itself in words: the plan's knobs in one phrase, and the summary block printed when a run
ends (and recorded in metrics.jsonl's `end` record, which `adaptive report` reads back). No torch: the report's
command imports this module too.

The end-of-run numbers, and how each is taken:

    wall_seconds         this launch: from the process's start (imports and setup included) to the end record.
                         A resumed or restarted run counts only its last launch; the earlier launches' steps
                         are in `train_seconds_total` (their records' step time), and `launches` says how many
    train_seconds        the optimizer steps' own time in this launch (no eval, checkpoint or export)
    tokens_per_s         this launch's tokens / step seconds, leaving out the launch's first step: it pays for
                         lazy allocation, kernel selection (cuBLAS, autotuning) and DeepSpeed's first-step
                         setup once, which on a short run would pull the mean down (on a GPU the first step is
                         often 10x the others; on a CPU about 1.3x). `warmup_seconds` is that first step
    mfu                  tokens_per_s x model FLOPs per token at the seq_len in force / the GPUs' peak; null
                         on a CPU (no catalog peak)
    peak_memory_bytes    CUDA: the highest `torch.cuda.max_memory_allocated` of the main process over the run;
                         CPU: the process's peak resident set (`getrusage`'s ru_maxrss). `peak_memory_kind` says
                         which ("cuda_allocated" or "cpu_rss"); `peak_rss_bytes` is the host's on any device
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def knobs_line(knobs: dict[str, Any]) -> str:
    """The knobs in force as a user reads them: "mb 4 x accum 1, seq 128, ZeRO 0, no offload, checkpointing off"
    (parallel sizes only when above 1, the block length only when the sequence is cut shorter)."""
    seq = f"seq {knobs['seq_len']}"
    if knobs.get("block_len") and knobs["block_len"] != knobs["seq_len"]:
        seq += f" (blocks of {knobs['block_len']} cut into pieces)"
    parts = [f"mb {knobs['micro_batch_size']} x accum {knobs['gradient_accumulation_steps']}", seq,
             f"ZeRO {knobs['zero_stage']}"]
    offloaded = [name for name, key in (("optimizer", "offload_optimizer"), ("params", "offload_params"))
                 if knobs.get(key)]
    parts.append(f"offload {' + '.join(offloaded)}" if offloaded else "no offload")
    policy = knobs.get("checkpoint_policy") or ("full" if knobs.get("gradient_checkpointing") else "off")
    parts.append(f"checkpointing {policy}")
    parts += [f"{name} {knobs[key]}" for name, key in (("EP", "ep_size"), ("SP", "sp_size"), ("TP", "tp_size"),
                                                         ("PP", "pp_size")) if knobs.get(key, 1) > 1]
    return ", ".join(parts)


def duration(seconds: float | None) -> str:
    """12.3 s, 4m 05s, 2h 03m."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def gib(num_bytes: float | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 2**30:.2f} GiB"


def peak_bytes(record: dict[str, Any]) -> int | None:
    """A train record's peak memory: the CUDA device's peak allocated, else (a CPU run) the process's peak RSS."""
    memory = record.get("memory")
    if memory and memory.get("peak_allocated_bytes") is not None:
        return memory["peak_allocated_bytes"]
    return record.get("peak_rss_bytes")


MEMORY_LABELS = {"cuda_allocated": "GPU peak allocated", "cpu_rss": "process peak RSS"}


@dataclass
class LaunchTotals:
    """What the loop adds up over one launch's optimizer steps (the main process's own clock)."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    warmup_seconds: float | None = None  # the launch's first step
    warmup_tokens: int = 0
    first_step: int = 0  # the step the launch started from (0, or the checkpoint's)

    def add(self, seconds: float, tokens: int) -> None:
        if self.steps == 0:
            self.warmup_seconds, self.warmup_tokens = seconds, tokens
        self.steps += 1
        self.tokens += tokens
        self.seconds += seconds

    def tokens_per_s(self) -> float | None:
        """Mean over the launch's steps after its first (all of them when it ran only one)."""
        tokens, seconds = self.tokens, self.seconds
        if self.steps > 1 and self.warmup_seconds is not None:
            tokens, seconds = tokens - self.warmup_tokens, seconds - self.warmup_seconds
        return tokens / seconds if seconds > 0 else None


def generate_command(hf_dir: Path | str, chat: bool = False, remote_code: bool = False) -> str:
    """A one-line check that the export loads and generates with transformers alone (`remote_code`: the export
    carries its modeling code, MoD and hybrid, which transformers runs only when trusted)."""
    prompt, answer = ("[{'role': 'user', 'content': 'Hello!'}]", "[-1]['content']") if chat else ("'The devil is'", "")
    trust = ", trust_remote_code=True" if remote_code else ""
    code = (f"from transformers import pipeline; g = pipeline('text-generation', model={str(hf_dir)!r}{trust}); "
            f"print(g({prompt}, max_new_tokens=20)[0]['generated_text']{answer})")
    plain = not any(c in str(hf_dir) for c in "'\"$`\\!")  # else the shell's own quoting, harder to read
    return f'python -c "{code}"' if plain else f"python -c {shlex.quote(code)}"


def summary_lines(end: dict[str, Any]) -> list[str]:
    """The end-of-run block, one line each, from the `end` record."""
    resumed = end.get("launches", 1) > 1
    wall = duration(end.get("wall_seconds")) + (" (this launch; resumed at step "
                                                f"{end.get('first_step')})" if resumed else "")
    lines = [f"wall time   {wall}, of which training steps {duration(end.get('train_seconds'))}"
             + (f", all launches' steps {duration(end.get('train_seconds_total'))}" if resumed else "")]
    lines.append(f"steps       {end['step']:,} ({end.get('tokens_seen') or 0:,} tokens)")
    loss = end.get("loss")
    line = f"final loss  train {loss:.4f}" if loss is not None else "final loss  train -"
    if loss is not None and (end.get("loss_steps") or 1) > 1:
        line += f" (mean of the last {end['loss_steps']} steps)"
    if end.get("eval_loss") is not None:
        line += f", eval {end['eval_loss']:.4f} (ppl {end['eval_ppl']:.2f})" if end.get("eval_ppl") else \
            f", eval {end['eval_loss']:.4f}"
    lines.append(line)
    tps = end.get("tokens_per_s")
    speed = f"speed       {tps:,.0f} tokens/s" if tps else "speed       -"
    if tps and end.get("warmup_seconds") is not None and end.get("train_steps", 0) > 1:
        speed += f" (first step's warm-up, {duration(end['warmup_seconds'])}, left out)"
    speed += f", MFU {100 * end['mfu']:.1f}%" if end.get("mfu") is not None else ", MFU n/a (no peak FLOP/s for a CPU)" \
        if end.get("device") == "cpu" else ", MFU n/a"
    lines.append(speed)
    if end.get("peak_memory_bytes") is not None:
        host = f", host peak RSS {gib(end['peak_rss_bytes'])}" if end.get("peak_memory_kind") == "cuda_allocated" \
            and end.get("peak_rss_bytes") else ""
        lines.append(f"memory      {gib(end['peak_memory_bytes'])} "
                     f"{MEMORY_LABELS.get(end.get('peak_memory_kind'), 'peak')}{host}")
    run_dir = end.get("run_dir")
    lines.append(f"run folder  {run_dir}")
    if end.get("checkpoint"):
        lines.append(f"checkpoint  {end['checkpoint']}")
    if end.get("export"):
        lines.append(f"HF model    {end['export']}")
    if end.get("adapter"):
        lines.append(f"adapter     {end['adapter']}")
    lines.append("next:")
    lines.append(f"  adaptive report {shlex.quote(str(run_dir))}")
    if end.get("export_remote_code"):  # adaptive's format (MoD, hybrid): export says why no portable one fits
        lines.append(f"  adaptive export {shlex.quote(str(run_dir))}")
    if end.get("export"):
        command = generate_command(end["export"], chat=bool(end.get("finetune")),
                                   remote_code=bool(end.get("export_remote_code")))
        lines.append(f"  {command}")
    return lines


__all__ = ["LaunchTotals", "MEMORY_LABELS", "duration", "generate_command", "gib", "knobs_line", "peak_bytes",
           "summary_lines"]
