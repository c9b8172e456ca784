"""Compute time of a training step, operation by operation, from the shapes of the work.

One micro-batch on one GPU is a list of kernels, each timed by what bounds it:
- matmuls by their own (m, n, k) after the TP/EP split and the micro-batch: 2·m·n·k FLOPs at the GPU's largest
  achievable matmul rate (a sweep of cuBLAS shapes), on the share of its SMs the GEMM's 128 x 128 output tiles
  keep busy (tiles run in waves of one per SM: a 1024-square GEMM fills 64 of an H100's 132 SMs), never faster
  than its operands' bytes over the memory bandwidth. A linear layer is three GEMMs: forward (tokens, out, in),
  input gradient (tokens, in, out), weight gradient (out, in, tokens);
- attention (SDPA/flash) by the FLOPs it executes (causal: half the square) at a published flash-attention rate
  for its head size and sequence; eager attention as two batched matmuls and a score-sized softmax;
- memory-bound work (norms, RoPE, activations, residuals, the loss, MoE dispatch, MoD gather/scatter, gradient
  accumulation, the optimizer step) by the bytes it reads and writes over the achievable memory bandwidth. The
  per-token bytes and kernel counts of our blocks are counted on the real model classes, op by op
  (tests/fidelity/test_op_counts.py re-counts them with a TorchDispatchMode on shapes not used here);
- a launch floor per kernel: no kernel takes less than the time to issue it from eager PyTorch, which is what
  bounds a tiny model.

Checkpointing recomputes the forward of what it drops (all layers, every N-th, or the MLP halves). A fine-tune's
frozen linears skip their weight-gradient GEMM; LoRA adds its two thin GEMMs per target each way and the scaled add;
QLoRA dequantizes each 4-bit weight before each of its matmuls (bytes: finetune/roles.py). The figures
per GPU class, each with its source, are in hardware/kernel_figures.py. A software stack sustains a measured share
of these kernel speeds over a whole run (`STACKS`).
"""

from __future__ import annotations

import math
from functools import lru_cache

from adaptive.plan.architecture.params import count_params
from adaptive.plan.architecture.blocks import block_type
from adaptive.plan.architecture.families import resolve_targets
from adaptive.plan.architecture.presets import ModelSpec
from adaptive.plan.finetune.method import Finetune
from adaptive.plan.finetune.roles import NF4_BLOCK, param_roles
from adaptive.plan.hardware.kernel_figures import KernelFigures
from adaptive.record import record

# Bytes read and written per token by the memory-bound ops of one decoder block, as coefficients of the
# widths they touch (h hidden, q = heads·head_dim, kv = kv_heads·head_dim, f SwiGLU width), and kernels per block.
# "plain" (transformers-style ops) and "lean" (adaptive/models/lean.py) are counted with a TorchDispatchMode over
# the real blocks in bf16: every aten op that is neither a matmul, attention nor a view, its inputs' and outputs'
# bytes (tests/fidelity/test_op_counts.py counts them again on other shapes). Per block half:
#   attention half: RMSNorm (fp32 upcast, square, mean, rsqrt, scale, cast, weight) + residual add: attn_h·h;
#                   RoPE on q and k (cos/sin products, rotate_half's cat and neg): rope·(q + kv)
#   MLP half:       RMSNorm + residual add: mlp_h·h; SiLU and the gate product: swiglu·f
# "fused" is a stack whose elementwise work runs in fused kernels that read each input and write each output
# once (Megatron's fused layer norm, bias-GeLU/SwiGLU, RoPE and bias-dropout-add; torch.compile; llm.c):
#   norm 2h in + 2h out, residual add 2 x 2h in + 2h out; RoPE 2 in + 2 out per q/k value; SwiGLU 4f in + 2f out;
#   backward reads the output gradient and the saved inputs and writes the input gradients (about twice).
# "native" is a GPT-2 block of PyTorch's own kernels (nn.LayerNorm, nn.GELU, learned positions) under autocast with
# fp32 weights, as single-GPU training scripts run it: the residual stream and the norms in fp32, and every weight
# cast to 16-bit for each micro-batch (AUTOCAST_CAST_BYTES_PER_PARAM); counted on transformers' GPT2LMHeadModel
# (activation "gelu") under torch.autocast, per h: 72 forward, 126 backward, the MLP's 4h included.
FWD = {"plain": {"attn_h": 42.7, "rope": 19.8, "mlp_h": 42.7, "swiglu": 9.9},
       "lean": {"attn_h": 42.7, "rope": 19.8, "mlp_h": 42.7, "swiglu": 9.9},
       "fused": {"attn_h": 10.0, "rope": 4.0, "mlp_h": 10.0, "swiglu": 3.0},
       "native": {"attn_h": 36.1, "rope": 0.0, "mlp_h": 36.1, "swiglu": 0.0}}
BWD = {"plain": {"attn_h": 111.7, "rope": 23.8, "mlp_h": 111.7, "swiglu": 17.9},
       "lean": {"attn_h": 103.7, "rope": 23.8, "mlp_h": 103.7, "swiglu": 27.9},  # lean recomputes SiLU·up
       "fused": {"attn_h": 20.0, "rope": 8.0, "mlp_h": 20.0, "swiglu": 5.0},
       "native": {"attn_h": 63.1, "rope": 0.0, "mlp_h": 63.1, "swiglu": 0.0}}
# memory-bound kernels per block half (forward, backward), counted with the bytes
KERNELS_FWD = {"plain": {"attn": 22, "mlp": 8}, "lean": {"attn": 22, "mlp": 8}, "fused": {"attn": 3, "mlp": 3},
               "native": {"attn": 9, "mlp": 5}}
KERNELS_BWD = {"plain": {"attn": 34, "mlp": 18}, "lean": {"attn": 32, "mlp": 16}, "fused": {"attn": 6, "mlp": 6},
               "native": {"attn": 9, "mlp": 7}}
AUTOCAST_CAST_BYTES_PER_PARAM = {"native": 12.0}  # fp32 read + 16-bit written, forward and again in backward
# The head: final RMSNorm, the embedding lookup and its gradient, the loss over V logits (plain: an fp32 copy and
# its log-softmax; lean: tiles, recomputed in backward; fused: one pass over the 16-bit logits each way).
# Per token: (per h, per V), and per micro-batch per V·h (the embedding table's gradient), forward and backward;
# kernels (forward, backward).
HEAD_FWD = {"plain": (48.0, 18.0), "lean": (48.0, 18.0), "fused": (10.0, 6.0), "native": (29.8, 17.5)}
HEAD_BWD = {"plain": (98.1, 26.0), "lean": (96.3, 40.0), "fused": (20.0, 6.0), "native": (30.5, 26.0)}
HEAD_TABLE_FWD = {"plain": 2.0, "lean": 2.0, "fused": 2.0, "native": 10.5}
HEAD_TABLE_BWD = {"plain": 2.0, "lean": 6.0, "fused": 2.0, "native": 22.0}
HEAD_KERNELS = {"plain": (25, 21), "lean": (30, 28), "fused": (4, 6), "native": (10, 10)}
# MoE: the router's fp32 softmax and top-k, the sort of the slots by expert, the gather into k·cf slots per token
# and the weighted scatter back, per slot and hidden unit (counted on our MoE block like the dense ones above);
# MoD: the router score, top-k over the sequence, the gather of the chosen tokens and the scatter back.
MOE_DISPATCH_BYTES_PER_SLOT_H = {"fwd": 34.0, "bwd": 48.0}
MOE_ROUTER_KERNELS, MOD_ROUTER_KERNELS = 27, 10
BACKWARD_BYTES_FACTOR = 2.0  # MoD's gather/scatter backward moves its forward bytes twice
# Eager attention: HF's scores (16-bit), mask add, fp32 softmax and its cast back, per score element
EAGER_SCORE_BYTES_FWD, EAGER_SCORE_BYTES_BWD = 20.0, 24.0
# FlashAttention's backward runs 2.5x its forward's matmul FLOPs (FlashAttention-2 paper's convention)
FLASH_BWD_FLOPS = 2.5
# Gradient accumulation in the 16-bit gradients each micro-batch (read both, write one), per local parameter;
# AdamW on the GPU: fp32 master, m, v and gradient read, master, m, v written, the 16-bit copy, and the norm's read
GRAD_ACCUM_BYTES_PER_PARAM = 6.0
ADAM_BYTES_PER_PARAM = 34.0
OPTIMIZER_KERNELS = 8  # multi-tensor-apply launches over flat buffers: norm, clip, step, copy (order of ten)
# LoRA's `result + lora_B(lora_A(x)) * scaling`: the scale (read and write the B output) and the add (read two, write
# one), 16-bit, per output value; backward about the same
LORA_ELEMENTWISE_BYTES = 10.0
LORA_KERNELS = 2
# QLoRA: bitsandbytes' dequantize_4bit reads the packed codes (0.5 byte per weight) and the block absmaxes
# (dequantized from bytes first) and writes the 16-bit weight
DEQUANT_BYTES_PER_WEIGHT = 0.5 + 2.0 + (1 + 4 + 4) / NF4_BLOCK
DEQUANT_KERNELS = 2


@record
class Stack:
    """A software stack that runs the kernels: how it runs the elementwise work, and the share of the kernels'
    benchmark speed it sustains over a whole run (what isolated kernel benchmarks leave out: clocks under
    sustained load, the GPU idle between kernels while Python, hooks and synchronisations run, cold caches)."""

    name: str
    elementwise: str | None  # "fused", or None: the model's own ops (the setup's `kernels`, plain or lean)
    efficiency: float
    source: str


# Each efficiency is measured on published runs of its stack (tests/plan/evidence/test_corpus.py recomputes it from
# the corpus); the corpus's other runs of the stack check it (docs/BENCHMARKS.md).
STACKS = {s.name: s for s in (
    Stack("eager", None, 0.61,
          "eager PyTorch modules on DeepSpeed (adaptive's recipes, transformers' models): the median over the 8 "
          "HF Llama-7B + DeepSpeed ZeRO-2/3 runs of gist.github.com/chenyaofo/d4cd6a20ab4b95cb3a49491747e2139a "
          "(A800 x 8: 0.53-0.66) of modelled over measured compute time"),
    Stack("fused", "fused", 0.77,
          "hand-fused kernels in a multi-GPU framework (Megatron-DeepSpeed, llm-foundry): BLOOM-176B's logged iteration on "
          "384 A100-80GB (bigscience-workshop/bigscience train/tr11-176B-ml: 104.7 s, 149.8 TFLOP/s) implies 0.773"),
    Stack("compiled", "fused", 1.0,
          "torch.compile or hand-fused CUDA (nanoGPT, llm.c) on one node: the kernels' own speed; nanoGPT's GPT-2 "
          "124M on one RTX 4090 (karpathy/nanoGPT PR #225: 4.62 s per 491,520 tokens) runs within 6% of it"),
)}


@record
class Rates:
    """One GPU's rates: its peak (what --gpu-tflops sets), its memory bandwidth and its class's kernel figures."""

    peak_flops: float
    bytes_per_s: float  # achievable: the datasheet bandwidth x the class's measured fraction
    kf: KernelFigures

    def __hash__(self) -> int:
        return hash((self.peak_flops, self.bytes_per_s, self.kf))


def rates_of(gpu) -> Rates:
    kf = gpu.figures.kernels
    return Rates(peak_flops=gpu.peak_tflops * 1e12, bytes_per_s=gpu.memory_bandwidth_gbps * 1e9 * kf.memory_fraction,
                 kf=kf)


@record
class OpTimes:
    """Seconds by kind of work, and the kernels behind them."""

    matmul_s: float = 0.0
    attention_s: float = 0.0
    memory_s: float = 0.0
    launch_s: float = 0.0  # what the launch floor adds where kernels are shorter than it
    kernels: float = 0.0
    matmul_flops: float = 0.0  # 2·m·n·k over the GEMMs (checked against torch's FlopCounterMode)

    @property
    def total_s(self) -> float:
        return self.matmul_s + self.attention_s + self.memory_s + self.launch_s

    def __add__(self, o: OpTimes) -> OpTimes:
        return OpTimes(self.matmul_s + o.matmul_s, self.attention_s + o.attention_s, self.memory_s + o.memory_s,
                       self.launch_s + o.launch_s, self.kernels + o.kernels, self.matmul_flops + o.matmul_flops)

    def scaled(self, x: float) -> OpTimes:
        return OpTimes(self.matmul_s * x, self.attention_s * x, self.memory_s * x, self.launch_s * x, self.kernels * x,
                       self.matmul_flops * x)


GEMM_TILE = 128  # output tile edge of cuBLAS's large-GEMM kernels (128 x 128 and 128 x 256 on Ampere/Hopper)
# a GEMM's fixed cost on the GPU beyond its tiles' work: back-to-back launches of tiny kernels measured 2.6 us on an
# A100 and 2.4 on an H200 (te42kyfo/gpu-benches gpu-small-kernels); the XLA H100 table's 256-cube GEMM takes 5 us
GEMM_CALL_S = 2.5e-6


def gemm_efficiency(m: float, n: float, r: Rates, batch: float = 1) -> float:
    """Fraction of the dense peak a GEMM of output m x n (`batch` of them in one batched kernel) reaches: the
    largest achievable rate, times the share of the SMs its output tiles keep busy over its waves."""
    tiles = math.ceil(batch) * math.ceil(m / GEMM_TILE) * math.ceil(n / GEMM_TILE)
    sms = r.kf.sm_count
    return r.kf.matmul_fraction * tiles / (math.ceil(tiles / sms) * sms)


def gemm_seconds(m: float, n: float, k: float, r: Rates, batch: float = 1, bytes_per_value: int = 2) -> float:
    """One GEMM kernel's time (`batch` products of one shape, as torch.bmm runs them), without the launch floor."""
    compute = 2.0 * batch * m * n * k / (r.peak_flops * gemm_efficiency(m, n, r, batch))
    traffic = batch * (m * k + k * n + m * n) * bytes_per_value / r.bytes_per_s
    return max(compute, traffic) + GEMM_CALL_S


def _timed(seconds: float, kernels: float, r: Rates) -> tuple[float, float]:
    """(time of the work, extra time the launch floor adds), for `kernels` kernels sharing `seconds` evenly."""
    if kernels <= 0:
        return seconds, 0.0
    floor = kernels * r.kf.launch_us * 1e-6
    return seconds, max(0.0, floor - seconds)


def _memory(nbytes: float, kernels: float, r: Rates) -> OpTimes:
    t, extra = _timed(nbytes / r.bytes_per_s, kernels, r)
    return OpTimes(memory_s=t, launch_s=extra, kernels=kernels)


@record
class LinearRole:
    """How a fine-tune trains one linear layer: its weight trains (or is frozen), a LoRA adapter of `rank` on it,
    its weight held in NF4."""

    trains: bool = True
    rank: int = 0
    nf4: bool = False


TRAINED = LinearRole()
FROZEN = LinearRole(trains=False)


def _linear(tokens: float, n_out: float, k_in: float, r: Rates, count: float = 1.0,
            phases: tuple[str, ...] = ("fwd",), batch: float = 1, role: LinearRole = TRAINED) -> OpTimes:
    """A linear layer's GEMMs: forward, or its two backward GEMMs (one when its weight is frozen); `count` separate
    kernels (experts in a loop), each of `batch` products (attention's per-head matmuls in one batched kernel). A LoRA
    adapter adds A (rank x in) and B (out x rank) each way and its scaled add; an NF4 weight is dequantized first."""
    rank = role.rank
    shapes = {"fwd": [(tokens, n_out, k_in)],
              "bwd": [(tokens, k_in, n_out)] + ([(n_out, k_in, tokens)] if role.trains else [])}
    if rank:
        shapes["fwd"] += [(tokens, rank, k_in), (tokens, n_out, rank)]
        shapes["bwd"] += [(tokens, rank, n_out), (n_out, rank, tokens), (tokens, k_in, rank), (rank, k_in, tokens)]
    out = OpTimes()
    for phase in phases:
        for m, n, k in shapes[phase]:
            if m <= 0 or n <= 0 or k <= 0:
                continue
            t, extra = _timed(gemm_seconds(m, n, k, r, batch), 1, r)
            out = out + OpTimes(matmul_s=t * count, launch_s=extra * count, kernels=count,
                                matmul_flops=2.0 * m * n * k * batch * count)
        if rank:
            out = out + _memory(LORA_ELEMENTWISE_BYTES * tokens * n_out * count, LORA_KERNELS * count, r)
        if role.nf4:
            out = out + _memory(DEQUANT_BYTES_PER_WEIGHT * n_out * k_in * count, DEQUANT_KERNELS * count, r)
    return out


def attention_tflops(head_dim: int, seq: int, r: Rates) -> float:
    """Flash attention's forward+backward TFLOP/s (FlashAttention-2's FLOPs convention) at this head size and
    sequence: the long-sequence figure at head dim 128, lowered for short sequences and small heads."""
    return (r.kf.attention_fraction * r.peak_flops / 1e12 * seq / (seq + r.kf.attention_half_seq)
            * head_dim / (head_dim + r.kf.attention_half_head_dim) * (128 + r.kf.attention_half_head_dim) / 128)


@record
class Work:
    """What one micro-batch runs on one GPU (its share after TP, SP and EP)."""

    tokens: float  # tokens a dense block's linears see on this GPU
    seq: int  # the sequence attention spans
    tp: int
    sp: int
    ep: int
    capacity_factor: float
    kernels: str  # the elementwise ops' family: "lean" or "plain" (activations.py), "fused" or "native" (FWD above)
    attention: str  # "sdpa" (flash) or "eager"
    finetune: Finetune | None = None  # None: every weight trains

    def role(self, s: ModelSpec, linear: str) -> LinearRole:
        """How this run trains a decoder block's linear: q, k, v, o, gate, up, down, shared_* (Qwen2-MoE's shared
        expert), expert_* (routed experts, 3D parameters in transformers 5) or router. Under LoRA every weight is
        frozen; PEFT may adapt the experts and the router in place (families.PEFT_MOE_TARGETS); bitsandbytes quantizes
        nn.Linear modules only."""
        ft = self.finetune
        if ft is None or not ft.adapted:
            return TRAINED
        return LinearRole(trains=False, rank=_adapted(s, ft).get(linear, 0), nf4=ft.quantized and linear in _LINEARS)


_LINEARS = ("q", "k", "v", "o", "gate", "up", "down", "shared_gate", "shared_up", "shared_down")
_SHORT = {"q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "qkv_proj": ("q", "k", "v"), "o_proj": ("o",),
          "gate_proj": ("gate",), "up_proj": ("up",), "gate_up_proj": ("gate", "up"), "down_proj": ("down",)}


@lru_cache(maxsize=256)
def _adapted(s: ModelSpec, ft: Finetune) -> dict[str, int]:
    """The block linears (as Work.role names them) that carry a LoRA adapter, and its rank."""
    out: dict[str, int] = {}
    for m in resolve_targets(s, ft.lora_targets):
        rank = ft.lora_rank * m.rank_factor
        if m.role == "router":
            out["router"] = rank
            continue
        prefix = {"shared_expert": "shared_", "experts": "expert_"}.get(m.role, "")
        out.update((prefix + n, rank) for n in _SHORT.get(m.leaf, ()))
    return out


def _attention_half(s: ModelSpec, w: Work, tokens: float, seq: float, r: Rates,
                    phase: str) -> OpTimes:
    h, q, kv = s.hidden_size, s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    t = w.tp
    out = OpTimes()
    for name, n_out, k_in in (("q", q / t, h), ("k", kv / t, h), ("v", kv / t, h), ("o", h, q / t)):  # o row-parallel
        out = out + _linear(tokens, n_out, k_in, r, phases=(phase,), role=w.role(s, name))
    # attention: sequences of `seq` tokens, heads split by tp and sp (Ulysses gives each rank whole heads)
    heads = s.num_attention_heads / (t * w.sp)
    seqs = tokens * w.sp / seq  # sequences this GPU attends over (Ulysses gathers whole sequences)
    if w.attention == "eager":
        for m, n, k in ((seq, seq, s.head_dim), (seq, s.head_dim, seq)):  # scores = QK^T, out = PV, per head
            out = out + _linear(m, n, k, r, phases=(phase,), batch=seqs * heads)
        per_score = EAGER_SCORE_BYTES_FWD if phase == "fwd" else EAGER_SCORE_BYTES_BWD
        out = out + _memory(per_score * seqs * heads * seq * seq, 4 if phase == "fwd" else 6, r)
    else:
        flops_fwd = 4.0 * seqs * heads * seq * seq * s.head_dim / 2  # causal: half the square
        flops = flops_fwd if phase == "fwd" else flops_fwd * FLASH_BWD_FLOPS
        rate = attention_tflops(s.head_dim, int(seq), r) * 1e12
        t_att, extra = _timed(flops / rate, 1, r)
        out = out + OpTimes(attention_s=t_att, launch_s=extra, kernels=1)
    c = (FWD if phase == "fwd" else BWD)[w.kernels]
    k = (KERNELS_FWD if phase == "fwd" else KERNELS_BWD)[w.kernels]["attn"]
    nbytes = tokens * (c["attn_h"] * h + c["rope"] * (q + kv) / t)
    return out + _memory(nbytes, k, r)


def _mlp_half(s: ModelSpec, w: Work, tokens: float, experts: bool, r: Rates,
              phase: str) -> OpTimes:
    h, t = s.hidden_size, w.tp
    c = (FWD if phase == "fwd" else BWD)[w.kernels]
    k = (KERNELS_FWD if phase == "fwd" else KERNELS_BWD)[w.kernels]["mlp"]
    out = _memory(tokens * c["mlp_h"] * h, k - 2, r)

    def swiglu(rows: float, f: float, count: float, prefix: str = "") -> OpTimes:
        o = OpTimes()
        for name, n_out, k_in in (("gate", f / t, h), ("up", f / t, h), ("down", h, f / t)):  # down row-parallel
            o = o + _linear(rows, n_out, k_in, r, count=count, phases=(phase,), role=w.role(s, prefix + name))
        return o + _memory(rows * count * c["swiglu"] * f / t, 2 * count, r)

    if not experts:
        return out + swiglu(tokens, s.intermediate_size, 1)
    e_local = s.num_local_experts / w.ep
    slots = tokens * s.num_experts_per_tok * w.capacity_factor  # this GPU's tokens' slots, spread over EP ranks
    rows = slots / s.num_local_experts * w.ep  # each local expert's rows: all EP ranks' tokens for it
    out = out + _linear(tokens, s.num_local_experts, h, r, phases=(phase,), role=w.role(s, "router"))
    out = out + _memory(MOE_DISPATCH_BYTES_PER_SLOT_H[phase] * slots * h, MOE_ROUTER_KERNELS, r)
    out = out + swiglu(rows, s.moe_intermediate_size, e_local, "expert_")
    if s.shared_expert_intermediate_size:
        out = out + swiglu(tokens, s.shared_expert_intermediate_size, 1, "shared_")
    return out


def layer_times(s: ModelSpec, layer_type: str, w: Work, r: Rates, phase: str,
                half: str = "both") -> OpTimes:
    """One decoder block's forward or backward on one GPU for one micro-batch; `half`: "both", "attn" or "mlp"."""
    kind = block_type(layer_type)
    tokens, seq = w.tokens, float(w.seq)
    out = OpTimes()
    if kind.routed:  # MoD: a scalar router per token, then the top-k tokens of each sequence run the block
        k_seq = s.mod_tokens(w.seq)
        frac = k_seq / w.seq
        factor = 1.0 if phase == "fwd" else BACKWARD_BYTES_FACTOR
        out = out + _memory(factor * (2 * s.hidden_size * tokens + 8 * s.hidden_size * tokens * frac),
                            factor * MOD_ROUTER_KERNELS, r)
        tokens, seq = tokens * frac, float(k_seq)
    if half in ("both", "attn"):
        out = out + _attention_half(s, w, tokens, seq, r, phase)
    if half in ("both", "mlp"):
        out = out + _mlp_half(s, w, tokens, kind.has_experts, r, phase)
    return out


def head_times(s: ModelSpec, w: Work, r: Rates, phase: str) -> OpTimes:
    """Embedding, final norm, LM head and loss; the lean loss recomputes its logits in backward."""
    h, v = s.hidden_size, s.vocab_size
    phases = ("fwd",) if phase == "fwd" else (("bwd", "fwd") if w.kernels == "lean" else ("bwd",))
    frozen = w.finetune is not None and w.finetune.adapted  # LoRA: the LM head and the embedding table train not
    out = _linear(w.tokens, v / w.tp, h, r, phases=phases, role=FROZEN if frozen else TRAINED)
    per_h, per_v = (HEAD_FWD if phase == "fwd" else HEAD_BWD)[w.kernels]
    table = 0.0 if frozen and phase == "bwd" else (HEAD_TABLE_FWD if phase == "fwd" else HEAD_TABLE_BWD)[w.kernels]
    k = HEAD_KERNELS[w.kernels][0 if phase == "fwd" else 1]
    return out + _memory(w.tokens * (per_h * h + per_v * v / w.tp) + table * v * h / w.tp, k, r)


def local_params(setup) -> float:
    """Trained parameters one GPU holds whole before ZeRO partitions them: its experts (1/ep), its TP shards; a
    LoRA run's adapters."""
    from adaptive.plan.estimate.parallel import tp_sharded_params

    if setup.finetune is not None and setup.finetune.adapted:
        return float(param_roles(setup.spec, setup.finetune).trainable)
    counts = count_params(setup.spec)
    local = counts.total - counts.expert + counts.expert / setup.ep_size
    if setup.tp_size > 1:
        replicated = counts.total - tp_sharded_params(setup.spec, counts.total)
        local = (local - replicated) / setup.tp_size + replicated
    return local / setup.pp_size


def work_of(setup) -> Work:
    return Work(tokens=setup.tokens_per_micro_batch / setup.sp_size, seq=setup.seq_len, tp=setup.tp_size,
                sp=setup.sp_size, ep=setup.ep_size, capacity_factor=setup.capacity_factor,
                kernels=setup.elementwise or STACKS[setup.stack].elementwise or setup.kernels,
                attention=setup.attention, finetune=setup.finetune)


@lru_cache(maxsize=4096)
def _layers(s: ModelSpec, w: Work, r: Rates, phase: str, half: str) -> OpTimes:
    out = OpTimes()
    for t in dict.fromkeys(s.layer_types):  # each block type once (in a fixed order), times its count
        out = out + layer_times(s, t, w, r, phase, half).scaled(s.layer_types.count(t))
    return out


@record
class MicroBatchTimes:
    """One micro-batch on one GPU: forward, backward, and the forward that checkpointing runs again."""

    forward: OpTimes
    backward: OpTimes
    recompute: OpTimes
    grad_accumulation: OpTimes  # adding this micro-batch's gradients to the 16-bit ones held (autocast's casts too)

    @property
    def total(self) -> OpTimes:
        return self.forward + self.backward + self.recompute + self.grad_accumulation


def micro_batch_times(setup, r: Rates) -> MicroBatchTimes:
    s, w = setup.spec, work_of(setup)
    fwd = _layers(s, w, r, "fwd", "both") + head_times(s, w, r, "fwd")
    bwd = _layers(s, w, r, "bwd", "both") + head_times(s, w, r, "bwd")
    policy = setup.checkpointing
    if policy == "off":
        redo = OpTimes()
    elif policy == "mlp":
        redo = _layers(s, w, r, "fwd", "mlp")
    else:
        layers = len(s.layer_types)
        n = 1 if policy == "full" else int(policy.split(":")[1])
        redo = _layers(s, w, r, "fwd", "both").scaled(math.ceil(layers / n) / layers)
    per_param = GRAD_ACCUM_BYTES_PER_PARAM + AUTOCAST_CAST_BYTES_PER_PARAM.get(w.kernels, 0.0)
    grads = _memory(per_param * local_params(setup), OPTIMIZER_KERNELS, r)
    return MicroBatchTimes(forward=fwd, backward=bwd, recompute=redo, grad_accumulation=grads)


def optimizer_times(setup, r: Rates) -> OpTimes:
    """The optimizer step on the GPU (none when it is offloaded to the CPU): AdamW over this GPU's partition."""
    if setup.offload_optimizer:
        return OpTimes()
    params = local_params(setup)
    if setup.zero_stage >= 1:
        params /= setup.zero_group_size
    return _memory(ADAM_BYTES_PER_PARAM * params, OPTIMIZER_KERNELS, r)


__all__ = ["MicroBatchTimes", "OpTimes", "Rates", "Work", "attention_tflops", "gemm_efficiency", "gemm_seconds",
           "head_times", "layer_times", "local_params", "micro_batch_times", "optimizer_times", "rates_of", "work_of"]
