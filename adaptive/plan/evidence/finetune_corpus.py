"""Published, measured fine-tunes and what `fit` predicts for each (`adaptive/plan/evidence/finetune_runs.json`).

Each entry cites its source (repository and commit or page, table and row, quoted), says what ran (`stack`) and of
which kind (`stack_kind`: "ours" is DeepSpeed with transformers' classes, PEFT and bitsandbytes, what adaptive
trains; "transformers_fsdp" the same classes under PyTorch FSDP; "torchtune", "fsdp_qlora" and "litgpt" the other
stacks), records the model's config.json fields, the GPUs, every knob the source states, and under `assumed` how
anything it leaves out was filled. The knobs include the stack's own (estimate/memory.py FRAMEWORKS and PRECISIONS,
estimate/losses.py LOSSES, `optimizer_in_backward`, `activation_offload`, and Finetune.nf4_keeps_input for
bitsandbytes before 0.43.2): the memory model follows the stack, no row is corrected by a factor. The outcome is
whether it ran and, where published, its peak: the figure as printed, its value and unit (GB = 1e9 bytes,
GiB = 2**30) and which counter it is. A row the tolerance does not hold says why in `excluded`, one line.

What each counter is compared with (COUNTERS):
- allocated: torch.cuda.max_memory_allocated -> MemoryEstimate.allocated_peak_bytes;
- active: torch.cuda.memory_stats()["active_bytes.all.peak"] (torchtune): blocks in use, the same quantity;
- unspecified: a log that holds active, allocated and reserved without saying which: compared as allocated (the row's
  `assumed` says so);
- reserved: torch.cuda.max_memory_reserved -> the allocated peak plus the allocator's fragmentation allowance;
- process: nvidia-smi or a GPU-memory chart, the whole process -> peak_gpu_bytes (fragmentation and CUDA context).

The tolerance (tests/plan/evidence/test_finetune_corpus.py): an allocated, active or unspecified peak within
PEAK_TOLERANCE; a reserved or process-level figure, which adds the caching allocator's reserve to the allocated peak,
bounds the plan's allocated peak from above (within the same tolerance) and is shown with its error; every fit or OOM
call right.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from adaptive.plan.architecture.presets import ModelSpec, spec_from_shape
from adaptive.plan.ds_config.reader import merge_ds_pins, parse as parse_ds_config
from adaptive.plan.evidence.corpus import read_runs, shape_for
from adaptive.plan.estimate.memory import FRAGMENTATION, MemoryEstimate
from adaptive.plan.finetune.method import Finetune, make_finetune
from adaptive.plan.hardware.gpus import get_gpu
from adaptive.plan.search.planner import FitRequest, Plan, fit

GiB = 2**30
DATA_FILE = "finetune_runs.json"
PEAK_TOLERANCE = 0.10  # the bound on every allocated peak
UNITS = {"GB": 1e9, "GiB": float(GiB)}
COUNTERS = {
    "allocated": "torch.cuda.max_memory_allocated",
    "active": "memory_stats active_bytes.all.peak",
    "unspecified": "one of active, allocated, reserved (compared as allocated)",
    "reserved": "torch.cuda.max_memory_reserved",
    "process": "the whole process (nvidia-smi, a GPU-memory chart)",
}
TWO_SIDED = ("allocated", "active", "unspecified")  # held within PEAK_TOLERANCE both ways
STACK_KNOBS = ("framework", "precision", "loss", "optimizer_in_backward", "activation_offload")


@dataclass(frozen=True)
class FinetunePrediction:
    entry: dict
    plan: Plan

    @property
    def id(self) -> str:
        return self.entry["id"]

    @property
    def fits(self) -> bool:
        return self.plan.fits

    @property
    def memory(self) -> MemoryEstimate:
        return self.plan.shown.memory

    @property
    def counter(self) -> str | None:
        peak = self.entry["outcome"].get("peak")
        return peak["counter"] if peak else None

    @property
    def published_bytes(self) -> float | None:
        peak = self.entry["outcome"].get("peak")
        return peak["value"] * UNITS[peak["unit"]] if peak else None

    @property
    def predicted_bytes(self) -> float | None:
        """The plan's quantity that matches the published counter."""
        return comparable_bytes(self.memory, self.counter) if self.counter else None

    @property
    def error(self) -> float | None:
        if self.published_bytes is None:
            return None
        return self.predicted_bytes / self.published_bytes - 1

    @property
    def allocated_error(self) -> float | None:
        """The plan's allocated peak against the published figure (a bound for reserved and process-level ones)."""
        if self.published_bytes is None:
            return None
        return self.memory.allocated_peak_bytes / self.published_bytes - 1

    @property
    def held(self) -> bool:
        """Held to the tolerance: a published peak and no stated reason to leave it out."""
        return self.published_bytes is not None and "excluded" not in self.entry

    @property
    def within_tolerance(self) -> bool:
        if self.counter in TWO_SIDED:
            return abs(self.error) <= PEAK_TOLERANCE
        return self.allocated_error <= PEAK_TOLERANCE  # reserved / process: an upper bound of the allocated peak

    @property
    def call_right(self) -> bool:
        return self.fits == self.entry["outcome"]["ran"]


def comparable_bytes(memory: MemoryEstimate, counter: str) -> float:
    """The quantity of the plan that a published counter measures (COUNTERS)."""
    if counter in TWO_SIDED:
        return float(memory.allocated_peak_bytes)
    if counter == "reserved":
        return memory.allocated_peak_bytes * (1 + FRAGMENTATION)
    if counter == "process":
        return float(memory.peak_gpu_bytes)
    raise ValueError(f"unknown counter {counter!r}; one of {', '.join(COUNTERS)}")


@lru_cache(maxsize=1)
def load() -> tuple[dict, ...]:
    """Every fine-tune entry, as stored."""
    return read_runs(DATA_FILE)


def spec_for(entry: dict) -> ModelSpec:
    """The config.json the entry records, as transformers' class of its family (`model_type`) trains it."""
    shape = shape_for(entry, max_positions=131072)
    return replace(spec_from_shape(shape, "dense"), source=f"hf:{entry['model']['model_type']}")


def finetune_for(knobs: dict[str, Any]) -> Finetune:
    method = knobs["finetune"]
    if method == "full":
        return make_finetune("full")
    ft = make_finetune(method, knobs["lora_rank"], knobs["lora_alpha"], knobs["lora_targets"], knobs["lora_dropout"])
    return replace(ft, nf4_keeps_input=knobs.get("nf4_keeps_input", False))


def request_for(entry: dict) -> FitRequest:
    """The entry planned with every knob it states pinned: data parallel only, its stack's knobs."""
    k: dict[str, Any] = entry["knobs"]
    spec = spec_for(entry)
    seq = k["seq_len"]
    zero, offload, micro, accum, optimizer = k["zero"], k["offload"], k["micro_batch"], k["grad_accum"], k["optimizer"]
    ds = parse_ds_config(k["ds_config"], f"corpus:{entry['id']}", spec.hidden_size) if "ds_config" in k else None
    if ds is not None:  # the file's explicit values pin knobs, as `fit --ds-config` does
        zero, offload, micro, accum, optimizer, _ = merge_ds_pins(
            ds, zero=zero, offload=offload, micro_batch=micro, grad_accum=accum, optimizer=optimizer,
            global_batch_tokens=None, seq_len=seq)
    stack = {name: k[name] for name in STACK_KNOBS if name in k}
    return FitRequest(spec=spec, gpu=get_gpu(entry["gpu"]), gpus_per_node=entry["gpus_per_node"],
                      num_nodes=entry.get("nodes", 1), seq_len=seq, zero_stage=zero, offload=offload,
                      micro_batch_size=micro, grad_accum=accum, gradient_checkpointing=k["checkpointing"],
                      optimizer=optimizer, attention=k.get("attention", "sdpa"), ds_config=ds, kernels="plain",
                      tp_size=1, sp_size=1, pp_size=1, zero_hpz=1, zero_quantized_weights=False,
                      zero_quantized_gradients=False, finetune=finetune_for(k), **stack)


def predict(entry: dict) -> FinetunePrediction:
    return FinetunePrediction(entry=entry, plan=fit(request_for(entry), suggest=False))


def predictions() -> list[FinetunePrediction]:
    return [predict(e) for e in load()]


__all__ = ["COUNTERS", "FinetunePrediction", "PEAK_TOLERANCE", "STACK_KNOBS", "TWO_SIDED", "UNITS",
           "comparable_bytes", "load", "predict", "predictions", "request_for", "spec_for"]
