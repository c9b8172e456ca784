"""Training metrics: what the loop accumulates per step, reduces on log steps, and writes to
`<output-dir>/metrics.jsonl`.

Per step the loop adds device tensors (no host sync); every `--log-every` steps one all-reduce
combines the interval over all ranks. MFU = tokens/s x the model FLOPs per token at the seq_len in
force (the plan's unless the OOM ladder shortened it) / (the
GPU's peak dense 16-bit FLOP/s x number of GPUs); there is no catalog peak for a CPU, so on a CPU
`mfu` is null.

metrics.jsonl: one JSON object per line, `kind` says which:

  kind "start" (each time a run starts or resumes): step, time, preset, arch, world_size, device,
      gpu (catalog name or null), precision, knobs {micro_batch_size, gradient_accumulation_steps,
      seq_len, gradient_checkpointing, zero_stage, offload_optimizer, offload_params, ep_size,
      block_len (the data blocks: --seq-len), checkpoint_policy (off, every:N, mlp, full)},
      ds_config_source, max_steps, tokens_per_step, params_total, params_active,
      model_flops_per_token, orchestrator {requested, enabled, reason}, resumed_from (path or null)
  kind "train" (every --log-every steps, and for the steps left at a stop or the end; values cover
      the steps since the previous record, so a resume after a stop starts a new interval):
      step                 optimizer steps done
      interval_steps       how many optimizer steps the record covers
      time                 unix seconds
      tokens_seen          global tokens consumed so far
      loss                 mean training loss (LM + weighted aux losses) over micro-batches and ranks
      lm_loss, aux_loss    its two parts (aux_loss null for a dense model)
      ppl                  exp(lm_loss)
      lr                   learning rate in force after the step
      grad_norm            global gradient norm before clipping, of the last step (null if unknown)
      tokens_per_s         global tokens / wall seconds of the training steps in the interval
      mfu                  model FLOPs utilisation (null without a known GPU peak)
      skipped_steps        steps whose gradients were discarded, since the start of training
      expert_counts        per MoE layer, tokens routed to each expert (before dropping), summed
                           over the interval and ranks: [[...E counts...] per layer], null if no MoE
      max_vio              per MoE layer, (max load - mean load) / mean load
      max_vio_max          the worst layer's max_vio
      dropped_fraction     per MoE layer, mean fraction of token-slots dropped by capacity
      mod_skip_rate        per MoD layer, mean fraction of tokens that skipped the block
      train_seconds        wall seconds of the interval's training steps (what tokens_per_s divides by)
      memory               {allocated_bytes, peak_allocated_bytes, reserved_bytes} of the main
                           process's CUDA device, peak since the previous record; null on CPU
      peak_rss_bytes       the main process's peak resident set (host memory) so far, on any device: a CPU
                           run's memory, a GPU run's offloaded states (getrusage: it cannot be reset per interval)
      knobs                {micro_batch_size, gradient_accumulation_steps, gradient_checkpointing,
                           checkpoint_policy, seq_len} in force (seq_len < block_len: each block cut into pieces of seq_len)
  kind "eval": step, time, eval_loss (LM loss, token-weighted), eval_ppl, eval_tokens
  kind "end": step, time, export (path of the final HF folder or null), skipped_steps, and the end-of-run
      summary's numbers (adaptive.train.reporting.summary says how each is taken): wall_seconds,
      train_seconds, train_seconds_total, train_steps, warmup_seconds, tokens_per_s, mfu, tokens_seen, loss,
      eval_loss, eval_ppl, peak_memory_bytes, peak_memory_kind, device, launches, first_step, run_dir,
      checkpoint, adapter (a LoRA/QLoRA fine-tune's adapter folder, else null), finetune (method or null)

With `--report-to`, the writer's sink hands every record to the experiment trackers too: the numbers of
train, eval and end records as `train/loss`, `train/max_vio/layer_0`, `eval/eval_loss`, ... at the record's
step (adaptive.train.reporting.trackers).
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from adaptive.durable import atomic_write_text
from adaptive.errors import AdaptiveError

METRICS_FILE = "metrics.jsonl"


def max_vio(counts: list[float]) -> float | None:
    """MaxVio of one layer's expert loads: (max - mean) / mean (DeepSeek-V3's balance metric)."""
    if not counts:
        return None
    mean = sum(counts) / len(counts)
    return (max(counts) - mean) / mean if mean > 0 else None


def mfu(tokens_per_s: float | None, model_flops_per_token: float, peak_tflops: float | None,
        num_gpus: int) -> float | None:
    """Model FLOPs utilisation; None when the peak is unknown (CPU) or nothing was measured."""
    if not tokens_per_s or not peak_tflops:
        return None
    return tokens_per_s * model_flops_per_token / (peak_tflops * 1e12 * num_gpus)


def cuda_memory(device: torch.device) -> dict[str, int] | None:
    """This process's CUDA memory; resets the peak so the next record covers its own interval."""
    if device.type != "cuda":
        return None
    out = {
        "allocated_bytes": torch.cuda.memory_allocated(device),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "reserved_bytes": torch.cuda.memory_reserved(device),
    }
    torch.cuda.reset_peak_memory_stats(device)
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (Linux reports ru_maxrss in KiB, macOS in bytes): one system call."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if os.uname().sysname == "Darwin" else rss * 1024


@dataclass
class StepStats:
    """One optimizer step's sums over its micro-batches, as device tensors (no host sync)."""

    loss: torch.Tensor
    lm_loss: torch.Tensor
    aux_loss: torch.Tensor
    micro_batches: int = 0
    expert_counts: torch.Tensor | None = None  # [L_moe, E]
    dropped_fraction: torch.Tensor | None = None  # [L_moe], summed over micro-batches
    mod_skip_rate: torch.Tensor | None = None  # [L_mod], summed over micro-batches
    routed: bool = False  # a routed model's step without per-layer statistics (pipeline stages): aux_loss still reported

    @classmethod
    def zeros(cls, device: torch.device) -> StepStats:
        z = torch.zeros((), device=device, dtype=torch.float64)
        return cls(z.clone(), z.clone(), z.clone())

    def add(self, outputs: Any, loss: torch.Tensor) -> None:
        """Add one micro-batch: its loss (LM + aux) and the model's router statistics (transformers' own classes, which
        a fine-tune trains, may carry neither)."""
        loss = loss.detach().to(torch.float64)
        aux = getattr(outputs, "aux_loss", None)
        aux = aux.detach().to(torch.float64) if aux is not None else None
        self.loss += loss
        self.lm_loss += loss - aux if aux is not None else loss
        if aux is not None:
            self.aux_loss += aux
        self.micro_batches += 1
        self.add_router_stats(getattr(outputs, "router_stats", None))

    def add_router_stats(self, stats: Any) -> None:
        """Add one micro-batch's router statistics (AdaptiveRouterStats, or None for a dense model)."""
        if stats is None:
            return
        if stats.expert_counts is not None:
            self.expert_counts = _acc(self.expert_counts, stats.expert_counts.detach().to(torch.float64))
            self.dropped_fraction = _acc(self.dropped_fraction, stats.dropped_fraction.detach().to(torch.float64))
        if stats.mod_skip_rate is not None:
            self.mod_skip_rate = _acc(self.mod_skip_rate, stats.mod_skip_rate.detach().to(torch.float64))

    def finite(self) -> torch.Tensor:
        return torch.isfinite(self.loss)


def _acc(total: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    return value.clone() if total is None else total + value


@dataclass
class IntervalMeter:
    """Sums the committed steps between two log records; `reduce()` makes the record's numbers."""

    device: torch.device
    steps: list[StepStats] = field(default_factory=list)
    train_seconds: float = 0.0
    tokens: int = 0

    def add(self, stats: StepStats, seconds: float, tokens: int) -> None:
        self.steps.append(stats)
        self.train_seconds += seconds
        self.tokens += tokens

    def reduce(self, accelerator: Any) -> dict[str, Any]:
        """One all-reduce over ranks; returns the interval's means and sums, and resets."""
        steps, self.steps = self.steps, []
        seconds, self.train_seconds = self.train_seconds, 0.0
        tokens, self.tokens = self.tokens, 0
        first = steps[0]
        shapes = [(name, getattr(first, name)) for name in ("expert_counts", "dropped_fraction", "mod_skip_rate")]
        parts = [torch.stack([s.loss for s in steps]).sum(), torch.stack([s.lm_loss for s in steps]).sum(),
                 torch.stack([s.aux_loss for s in steps]).sum(),
                 torch.tensor(float(sum(s.micro_batches for s in steps)), device=self.device, dtype=torch.float64)]
        flat = [p.reshape(1) for p in parts]
        for name, value in shapes:
            if value is not None:
                flat.append(torch.stack([getattr(s, name) for s in steps]).sum(0).reshape(-1))
        packed = torch.cat(flat)
        if accelerator is not None and accelerator.num_processes > 1:
            packed = accelerator.reduce(packed, reduction="sum")
        values = packed.tolist()
        loss_sum, lm_sum, aux_sum, micro = values[:4]
        out: dict[str, Any] = {"loss": loss_sum / micro, "lm_loss": lm_sum / micro,
                               "aux_loss": aux_sum / micro if first.expert_counts is not None
                               or first.mod_skip_rate is not None or first.routed else None}
        offset = 4
        for name, value in shapes:
            if value is None:
                out[name] = None
                continue
            n = value.numel()
            chunk = values[offset:offset + n]
            offset += n
            if name == "expert_counts":
                layers, experts = value.shape
                out[name] = [[int(round(c)) for c in chunk[i * experts:(i + 1) * experts]] for i in range(layers)]
            else:
                out[name] = [v / micro for v in chunk]  # mean over micro-batches of every rank
        out["seconds"] = seconds
        out["tokens"] = tokens
        out["steps"] = len(steps)
        return out


def train_record(*, step: int, tokens_seen: int, reduced: dict[str, Any], lr: float, grad_norm: float | None,
                 skipped_steps: int, flops_per_token: float, peak_tflops: float | None, num_gpus: int,
                 memory: dict[str, int] | None, knobs: dict[str, Any], rss_bytes: int | None = None) -> dict[str, Any]:
    """The `kind: "train"` record (see the module docstring)."""
    tokens_per_s = reduced["tokens"] / reduced["seconds"] if reduced["seconds"] > 0 else None
    counts = reduced["expert_counts"]
    vio = [max_vio([float(c) for c in layer]) for layer in counts] if counts is not None else None
    lm = reduced["lm_loss"]
    return {
        "kind": "train",
        "step": step,
        "interval_steps": reduced["steps"],
        "time": time.time(),
        "tokens_seen": tokens_seen,
        "loss": reduced["loss"],
        "lm_loss": lm,
        "aux_loss": reduced["aux_loss"],
        "ppl": math.exp(min(lm, 700.0)) if math.isfinite(lm) else None,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": tokens_per_s,
        "train_seconds": reduced["seconds"],
        "mfu": mfu(tokens_per_s, flops_per_token, peak_tflops, num_gpus),
        "skipped_steps": skipped_steps,
        "expert_counts": counts,
        "max_vio": vio,
        "max_vio_max": max((v for v in vio if v is not None), default=None) if vio else None,
        "dropped_fraction": reduced["dropped_fraction"],
        "mod_skip_rate": reduced["mod_skip_rate"],
        "memory": memory,
        "peak_rss_bytes": rss_bytes,
        "knobs": knobs,
    }


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _clean(value: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class MetricsWriter:
    """Appends records to metrics.jsonl (main process only; other ranks get a disabled writer). `sink`, when
    given, gets every record written too (the experiment trackers: adaptive.train.reporting.trackers.TrackerSink)."""

    def __init__(self, output_dir: Path, enabled: bool, sink: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.path = Path(output_dir) / METRICS_FILE
        self.enabled = enabled
        self.sink = sink

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = _clean(record)
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, default=_json_default) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:  # a full or read-only disk: one line, and the checkpoints keep the run
            raise AdaptiveError(f"{self.path} could not be written ({err.strerror or err}); fix that and --resume") \
                from None
        if self.sink is not None:
            self.sink(record)

    def truncate_after(self, step: int | None) -> None:
        """On resume: keep the records written before the first one of a later step; what follows is the
        abandoned history the run redoes (a rollback's records at earlier steps too). `None`: a fresh run
        in an old folder, which starts an empty file."""
        if not self.enabled or not self.path.exists():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines() if step is not None else []:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if record.get("step", 0) > step:
                break
            kept.append(line)
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))


def read_metrics(path: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, optionally of one kind."""
    records = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in records if kind is None or r.get("kind") == kind]


__all__ = ["METRICS_FILE", "IntervalMeter", "MetricsWriter", "StepStats", "cuda_memory", "max_vio", "mfu", "peak_rss_bytes",
           "read_metrics", "train_record"]
