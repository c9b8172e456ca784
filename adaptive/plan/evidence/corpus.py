"""Published training runs, and what `fit` predicts for each (`adaptive/plan/evidence/corpus_runs.json`).

Each entry cites its source (paper table, repository file and row, documentation page, issue thread),
records the model shape, the GPUs, every knob the source states (and, under `assumed`, how anything
it leaves out was filled), and the published outcome: ran or OOM, measured peak, tokens/s or
TFLOP/s per GPU, GPU-hours. `stack` says what the run used; `stack_kind` says whether that is what
`fit` models:

- "ours": DeepSpeed ZeRO with a transformers-style model (unfused PyTorch modules, the attention
  implementation given), as `adaptive` trains. Fit/OOM calls and speed are held to the tolerances;
- "fsdp": PyTorch FSDP with fused kernels (llm-foundry: FlashAttention, fused cross-entropy; torchtitan);
- "meta": Meta's in-house pre-training stacks (tensor/pipeline parallel, custom kernels);
- "moe-custom": MoE stacks with their own parallelism and FP8;
- "formula": a published formula rather than a run.
Other kinds are predicted and shown with their error, not held to a tolerance.

Shapes that are not Llama-style (GPT-2/MPT: GELU MLP of width 4h) are entered with a SwiGLU width of
8h/3, which gives the same parameters and FLOPs per token; their activations differ, which is one more
reason those rows are not "ours".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from importlib import resources
from typing import Any

from adaptive.plan.ds_config.reader import merge_ds_pins, parse as parse_ds_config
from adaptive.plan.hardware.gpus import get_gpu
from adaptive.plan.architecture.params import count_params
from adaptive.plan.search.planner import FitRequest, Plan, fit
from adaptive.plan.architecture.presets import ModelSpec, Shape, spec_from_shape

GiB = 2**30
DATA_FILE = "corpus_runs.json"
# Tolerances the done-when criteria of issue 10 state (tests/plan/evidence/test_corpus.py holds them).
GPU_HOURS_TOLERANCE = 0.15  # dense models up to 13B
# Issue 12: Meta's 70B-405B runs at their GPU counts, planned with DeepSpeed's TP/SP/ZeRO++
LARGE_GPU_HOURS_TOLERANCE = 0.30
LARGE_GPU_HOURS_RUNS = ("llama2-70b-gpu-hours", "llama3-70b-gpu-hours", "llama3.1-405b-gpu-hours")
# Issue 33: step time of every DeepSpeed / Megatron-DeepSpeed run; runs on consumer GPUs
SPEED_TOLERANCE = 0.15
CONSUMER_TOLERANCE = 0.20


@dataclass(frozen=True)
class Prediction:
    entry: dict
    plan: Plan
    fits: bool
    peak_gib: float
    tokens_per_s: float  # all GPUs
    tflops_per_gpu: float  # hardware FLOP/s per GPU (recompute included), as Megatron/DeepSpeed count
    mfu: float
    gpu_hours: float | None  # for the entry's training tokens

    @property
    def id(self) -> str:
        return self.entry["id"]


def read_runs(data_file: str) -> tuple[dict, ...]:
    """The `runs` of one of this package's evidence files (this corpus's, the fine-tune corpus's), as stored."""
    text = resources.files("adaptive.plan.evidence").joinpath(data_file).read_text()
    return tuple(json.loads(text)["runs"])


@lru_cache(maxsize=1)
def load() -> tuple[dict, ...]:
    """Every corpus entry, as stored."""
    return read_runs(DATA_FILE)


def shape_for(entry: dict, max_positions: int = 4096) -> Shape:
    """The decoder shape an entry's `model` records (`max_positions` where it gives none)."""
    m = entry["model"]
    return Shape(entry["id"], 0, vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
                 intermediate_size=m["intermediate_size"], num_hidden_layers=m["num_hidden_layers"],
                 num_attention_heads=m["num_attention_heads"],
                 num_key_value_heads=m.get("num_key_value_heads", m["num_attention_heads"]),
                 max_position_embeddings=m.get("max_position_embeddings", max_positions),
                 tie_word_embeddings=m.get("tie_word_embeddings", False))


def spec_for(entry: dict) -> ModelSpec:
    m = entry["model"]
    shape = shape_for(entry)
    arch = m.get("arch", "dense")
    if arch == "moe":
        # top-k set after building: DeepSpeed's gate stops at 2, a published top-8 run is counted as it ran
        spec = spec_from_shape(shape, "moe", num_experts=m["num_experts"], top_k=2,
                               moe_layer_freq=m.get("moe_layer_freq", 1))
        return replace(spec, num_experts_per_tok=m["top_k"],
                       moe_intermediate_size=m.get("moe_intermediate_size", m["intermediate_size"]),
                       shared_expert_intermediate_size=m.get("shared_expert_intermediate_size", 0))
    return spec_from_shape(shape, arch)


def request_for(entry: dict) -> FitRequest:
    k: dict[str, Any] = entry["knobs"]
    spec = spec_for(entry)
    ds = parse_ds_config(k["ds_config"], f"corpus:{entry['id']}", spec.hidden_size) if "ds_config" in k else None
    seq = k["seq_len"]
    zero, offload, micro, accum, optimizer, global_tokens = (k.get("zero"), k.get("offload"), k.get("micro_batch"),
                                                             k.get("grad_accum"), k.get("optimizer"),
                                                             k.get("global_batch_tokens"))
    if ds is not None:  # the file's explicit values pin knobs, as `fit --ds-config` does
        zero, offload, micro, accum, optimizer, global_tokens = merge_ds_pins(
            ds, zero=zero, offload=offload, micro_batch=micro, grad_accum=accum, optimizer=optimizer,
            global_batch_tokens=global_tokens, seq_len=seq)
    # a run states its layout: data parallel (tp/sp/pp 1, no ZeRO++) unless its knobs say otherwise; Meta's own
    # 4D-parallel stacks are left to the planner, which has only DeepSpeed's parallelism to offer (its pipeline included)
    free = entry["stack_kind"] == "meta"
    return FitRequest(
        sp_size=k.get("sp_size", None if free else 1), tp_size=k.get("tp_size", None if free else 1),
        pp_size=k.get("pp_size", None if free else 1),
        zero_hpz=k.get("zero_hpz", None if free else 1),
        zero_quantized_weights=k.get("zero_quantized_weights", None if free else False),
        zero_quantized_gradients=k.get("zero_quantized_gradients", None if free else False),
        spec=spec, gpu=get_gpu(entry["gpu"]), gpus_per_node=entry.get("gpus_per_node", 1),
        num_nodes=entry.get("nodes", 1), seq_len=seq, global_batch_tokens=global_tokens,
        train_tokens=k.get("train_tokens"), zero_stage=zero, offload=offload,
        micro_batch_size=micro, grad_accum=accum,
        gradient_checkpointing=k.get("checkpointing"), ep_size=k.get("ep_size"),
        capacity_factor=k.get("capacity_factor", 1.0), mfu=k.get("hfu"),
        optimizer=optimizer or "auto", attention=k.get("attention", "sdpa"), ds_config=ds,
        kernels=k.get("kernels", "plain"),  # published runs ran their own (transformers-style) ops, not ours
        stack=k.get("kernel_stack", "eager"),  # op_times.STACKS: Megatron's fused kernels, torch.compile
        elementwise=k.get("elementwise"))  # op_times.FWD: "native" for a GPT-2 of PyTorch's own kernels


def predict(entry: dict, req: FitRequest | None = None) -> Prediction:
    """`fit`'s answer for the entry, planned from its request (`request_for`) or from `req`, a variant of it."""
    req = req or request_for(entry)
    plan = fit(req, suggest=False)
    c = plan.shown
    t = c.throughput
    n = req.world_size
    train_tokens = entry["knobs"].get("train_tokens")
    hours = train_tokens / t.tokens_per_second * n / 3600 if train_tokens else None
    return Prediction(entry=entry, plan=plan, fits=plan.fits, peak_gib=c.memory.peak_gpu_bytes / GiB,
                      tokens_per_s=t.tokens_per_second,
                      tflops_per_gpu=t.tokens_per_second * t.hardware_flops_per_token / n / 1e12,
                      mfu=t.mfu, gpu_hours=hours)


def comparisons(p: Prediction) -> list[tuple[str, float, float, float]]:
    """(figure, published, predicted, relative error) for every figure the entry publishes."""
    o = p.entry["outcome"]
    n = p.plan.request.world_size
    out = []
    if o.get("tokens_per_s_per_gpu") is not None:
        out.append(("tokens/s per GPU", o["tokens_per_s_per_gpu"], p.tokens_per_s / n))
    if o.get("tflops_per_gpu") is not None:
        out.append(("TFLOP/s per GPU", o["tflops_per_gpu"], p.tflops_per_gpu))
    if o.get("mfu") is not None:
        out.append(("MFU", o["mfu"], p.mfu))
    if o.get("gpu_hours") is not None and p.gpu_hours is not None:
        out.append(("GPU-hours", o["gpu_hours"], p.gpu_hours))
    if o.get("peak_gib") is not None:
        out.append(("peak GiB", o["peak_gib"], p.peak_gib))
    if o.get("activation_bytes_per_layer") is not None:
        out.append(("activation bytes per layer", o["activation_bytes_per_layer"], activation_bytes_per_layer(p)))
    return [(name, pub, pred, pred / pub - 1) for name, pub, pred in out]


def activation_bytes_per_layer(p: Prediction) -> float:
    """Our count of one layer's saved activations at the entry's setup (attention implementation included)."""
    from adaptive.plan.estimate.activations import layer_bytes
    from adaptive.plan.estimate.attention import eager_extra_saved_bytes

    s = p.plan.shown.setup
    spec = s.spec
    saved = layer_bytes(spec, spec.layer_types[0], s.seq_len, s.micro_batch_size, s.capacity_factor)
    if s.attention == "eager":
        saved += eager_extra_saved_bytes(spec, s.seq_len, s.micro_batch_size) / spec.num_hidden_layers
    return saved


def measured_step_seconds(p: Prediction) -> float | None:
    """The step time the run's published speed implies for the planned step (tokens/s, else TFLOP/s per GPU)."""
    o, t = p.entry["outcome"], p.plan.shown.throughput
    n = p.plan.request.world_size
    if o.get("tokens_per_s_per_gpu"):
        return t.step_seconds * t.tokens_per_second / n / o["tokens_per_s_per_gpu"]
    if o.get("tflops_per_gpu"):
        return t.step_seconds * p.tflops_per_gpu / o["tflops_per_gpu"]
    return None


def implied_stack_efficiency(p: Prediction) -> float | None:
    """The stack efficiency (op_times.STACKS) at which the planned step takes as long as the published speed says,
    communication and offload kept as modelled; None without a published speed, or where those alone exceed it."""
    from adaptive.plan.estimate.op_times import STACKS
    from adaptive.plan.estimate.throughput import estimate_throughput

    measured = measured_step_seconds(p)
    c = p.plan.shown
    if measured is None or p.plan.request.mfu is not None:
        return None

    def step(scale: float) -> float:
        return estimate_throughput(c.setup, c.gpu, c.grad_accum, None, scale).step_seconds

    low, high = 1e-3, 1e3  # compute scales; the step grows with the scale
    if not step(low) < measured < step(high):
        return None
    for _ in range(60):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if step(mid) < measured else (low, mid)
    return STACKS[c.setup.stack].efficiency / low


def is_dense_up_to_13b(entry: dict) -> bool:
    return entry["model"].get("arch", "dense") == "dense" and count_params(spec_for(entry)).total <= 13.5e9


__all__ = ["Prediction", "load", "predict", "read_runs", "shape_for", "comparisons", "request_for", "spec_for",
           "is_dense_up_to_13b", "implied_stack_efficiency", "measured_step_seconds", "CONSUMER_TOLERANCE", "GPU_HOURS_TOLERANCE",
           "LARGE_GPU_HOURS_RUNS", "LARGE_GPU_HOURS_TOLERANCE", "SPEED_TOLERANCE"]
