"""What autograd saves in transformers' decoder classes, op by op, for any split of trained and frozen weights.

activations.py counts Llama's ops with every weight trained. A fine-tune freezes most weights, and a frozen weight
changes what its op keeps: a frozen nn.Linear (or bitsandbytes' Linear4bit, whose MatMul4Bit keeps only the packed
weight) keeps nothing; a frozen norm weight drops the 16-bit cast kept for its gradient; an op whose inputs need no
gradient keeps nothing at all (layer 0 of a LoRA run without checkpointing reads a frozen embedding). A LoRA
adapter keeps its input x (one storage with the other readers of x) and A·x (r values), or, with dropout, its own
dropped copy of x and a mask. So each block here is a small dataflow: `Flow` follows the tensors of one token
through the family's ops (families.py), every op keeps what PyTorch's derivative formula keeps given which of its
inputs need a gradient, and a storage kept by several ops counts once. tests/fidelity/test_finetune_activations.py
checks the sums against `saved_tensors_hooks` counts of the real classes with real PEFT and bitsandbytes.

Sizes are bytes per token in 16-bit activations; per-layer constants (Gemma's fp32 (1 + w) copies, grouped-GEMM
offsets, a LoRA'd expert stack's W + B·A) are kept apart. Routed experts (transformers 5: 3D weights, one grouped
GEMM, no capacity, no drops) keep per routed slot, k slots per token. Eager attention's scores are per token too:
heads x keys.

The backward's peaks (`Flow.moments`) are the layer's saved bytes at a few moments of its backward, plus the
gradients and temporaries it holds there: an MLP's (the gradients of its product, act and up), its norm's (fp32
temporaries), eager attention's (the score gradients), MoE's combine. Their sizes were measured on the CPU's kernels
(fake tensors; a GPU's may differ by their temporaries), tests/fidelity/test_finetune_activations.py.

Not modeled: an explicit attention mask (padding, or a sliding window shorter than the sequence) makes SDPA repeat k
and v to every head and keep the mask; Qwen3-MoE's `norm_topk_prob` renormalisation (4k + 4 bytes a token).
"""

from __future__ import annotations

from functools import lru_cache

from adaptive.plan.architecture.blocks import block_type
from adaptive.plan.architecture.families import HF_TYPES, family_of, resolve_targets
from adaptive.plan.architecture.presets import ModelSpec
from adaptive.plan.estimate.losses import LOSSES
from adaptive.plan.finetune.method import Finetune

# An RMSNorm's backward over h (measured on transformers' Llama and Gemma norms, CPU kernels): five fp32
# temporaries of h; a layer's last norm (Gemma's after the MLP) holds the incoming 16-bit gradient too; its MLP's
# norm one more fp32 temporary and the residual's gradient, 26 bytes in all
FINAL_NORM_BACKWARD = 5 * 4
LAST_NORM_BACKWARD = 5 * 4 + 2
NORM_BACKWARD = 6 * 4 + 2
MASK_BYTES = 1  # dropout's mask: CUDA's native_dropout keeps it as bool (the CPU's _dropout_impl: input dtype)
ROPE_CAT = ("phi3",)  # RoPE ends in a cat (partial rotary): q leaves it [b, a, s, d], so the attention output is
# laid out [b, a, s, d] too and `transpose(1, 2).contiguous()` copies it before o_proj
ROUTER_FP32_WEIGHTS = ("mixtral",)  # routing weights stay fp32 (renormalised in place), so the weighted sum is fp32


class Tensor:
    """One tensor of the block: bytes per token, whether autograd tracks it. A view is the same object."""

    __slots__ = ("nbytes", "grad")

    def __init__(self, nbytes: float, grad: bool):
        self.nbytes, self.grad = nbytes, grad


# The sites of families.py's PEFT_MOE_TARGETS (PEFT's LoRA on a parameter: the router's weight, the 3D experts)
EXPERT_SITES = {"mlp.gate": "router", "mlp.experts.gate_up_proj": "gate_up", "mlp.experts.down_proj": "down"}


def peft_targets(spec: ModelSpec, targets: str) -> tuple[frozenset[str], frozenset[str]]:
    """(the nn.Linear modules by name in a layer, the expert parameters: "router", "gate_up", "down") that PEFT's
    LoraConfig(target_modules=targets) adapts in transformers' class of this spec (families.resolve_targets)."""
    chosen = [m.name for m in resolve_targets(spec, targets)]
    return (frozenset(n for n in chosen if n not in EXPERT_SITES),
            frozenset(EXPERT_SITES[n] for n in chosen if n in EXPERT_SITES))


class Roles:
    """Who trains under a fine-tune: each linear by its name in a layer ("self_attn.q_proj"), the experts'
    parameters ("router", "gate_up", "down"), the rest by kind."""

    def __init__(self, spec: ModelSpec, finetune: Finetune | None):
        self.adapted = finetune is not None and finetune.adapted
        self.rank = finetune.lora_rank if self.adapted else 0
        self.dropout = finetune.lora_dropout if self.adapted else 0.0
        self.targets, self.expert_targets = (peft_targets(spec, finetune.lora_targets) if self.adapted
                                             else (frozenset(), frozenset()))
        self.trains = not self.adapted  # norms, embedding, head, routers and experts: trained unless adapted
        # an old bitsandbytes' 4-bit matmul keeps its input (Finetune.nf4_keeps_input); the head stays 16-bit
        self.nf4_keeps_input = finetune is not None and finetune.quantized and finetune.nf4_keeps_input

    def linear(self, name: str) -> str:
        """"train", "frozen" or "lora"."""
        if not self.adapted:
            return "train"
        return "lora" if name in self.targets else "frozen"

    def expert(self, name: str) -> str:
        """"train", "frozen" or "lora" (PEFT's ParamWrapper: the weight plus B·A, built in each forward)."""
        if not self.adapted:
            return "train"
        return "lora" if name in self.expert_targets else "frozen"


class Flow:
    """The tensors of one block, op by op, and the storages autograd keeps of them."""

    def __init__(self, spec: ModelSpec, roles: Roles, attention: str = "sdpa", seq_len: int = 0, cache: bool = True):
        self.spec, self.roles, self.family = spec, roles, family_of(spec)
        self.cache = cache  # transformers' classes build a DynamicCache in training unless checkpointing is on
        self.eager, self.keys = attention == "eager", seq_len  # eager attention: scores per token = heads · keys
        self.kept: dict[int, Tensor] = {}
        self.fixed = 0.0  # bytes per layer, not per token
        self.reads_rope = False  # a q or k that needs a gradient multiplied the shared cos/sin tables
        self.moments: list[tuple[float, float]] = []  # the layer's bytes (per token, per layer) at backward's peaks

    def keep(self, *ts: Tensor) -> None:
        for t in ts:
            self.kept[id(t)] = t

    @property
    def bytes_per_token(self) -> float:
        return sum(t.nbytes for t in self.kept.values())

    # --- ops: each keeps what its derivative formula needs for the inputs that need a gradient
    def linear(self, x: Tensor, out_bytes: float, name: str) -> Tensor:
        """nn.Linear: a trained weight keeps its input. A frozen one keeps nothing (its weight is a parameter).
        LoRA: the frozen base plus B(A(dropout(x))): A keeps its input (x itself at p = 0) and B keeps A·x."""
        role = self.roles.linear(name)
        if role == "train":
            self.keep(x)
            return Tensor(out_bytes, True)
        if self.roles.nf4_keeps_input and x.grad and name != "lm_head":
            self.keep(x)  # bitsandbytes < 0.43.2: the 4-bit base matmul keeps its input
        if role == "frozen":
            return Tensor(out_bytes, x.grad)
        src = x
        if self.roles.dropout > 0:  # one dropout per target: its own copy, its mask if x needs a gradient
            src = Tensor(x.nbytes, x.grad)
            if x.grad:
                self.keep(Tensor(x.nbytes / 2 * MASK_BYTES, False))
        self.keep(src, Tensor(2 * self.roles.rank, True))
        return Tensor(out_bytes, True)

    def norm(self, x: Tensor, width: int, rows: int = 1) -> Tensor:
        """RMSNorm over `width` (rows of it per token: heads for a q/k norm). Llama: w * (x32 / rms).to(16-bit)
        keeps x32 and 1/rms if x needs a gradient, the 16-bit cast if w trains. Gemma: (x32 / rms) * (1 + w) in
        fp32 keeps x32 and 1/rms, the fp32 normalised x if w trains, and the fp32 (1 + w) per layer."""
        trains = self.roles.trains
        if x.grad:
            self.keep(Tensor(4 * width * rows, False), Tensor(4 * rows, False))
        if self.family.norm == "gemma":
            if trains:
                self.keep(Tensor(4 * width * rows, x.grad))
            if x.grad:
                self.fixed += 4 * width
        elif trains:
            self.keep(Tensor(2 * width * rows, x.grad))
        return Tensor(2 * width * rows, x.grad or trains)

    def mul(self, a: Tensor, b: Tensor, out_bytes: float | None = None) -> Tensor:
        if b.grad:
            self.keep(a)
        if a.grad:
            self.keep(b)
        return Tensor(a.nbytes if out_bytes is None else out_bytes, a.grad or b.grad)

    def unary(self, x: Tensor) -> Tensor:
        """SiLU and tanh-GELU keep their input."""
        if x.grad:
            self.keep(x)
        return Tensor(x.nbytes, x.grad)

    def rope(self, x: Tensor) -> Tensor:
        """x * cos + rotate_half(x) * sin keeps cos and sin only (shared by the layers: counted with the head)."""
        self.reads_rope = self.reads_rope or x.grad
        return Tensor(x.nbytes, x.grad)

    # --- the block
    def attention(self, x: Tensor) -> Tensor:
        """q/k/v projections (or Phi-3's fused qkv), Qwen3/Gemma 3's q/k norms, RoPE, SDPA, o_proj. SDPA keeps q,
        k, v, its output and an fp32 log-sum-exp per head. With a cache, k and v are its copies; without, Phi-3's v
        is a view of qkv, which keeps all of qkv's storage."""
        s, f = self.spec, self.family
        heads, kv_heads, d = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        q_bytes, kv_bytes = 2 * heads * d, 2 * kv_heads * d
        if f.fused_qkv:
            qkv = self.linear(x, q_bytes + 2 * kv_bytes, "self_attn.qkv_proj")
            q, k = Tensor(q_bytes, qkv.grad), Tensor(kv_bytes, qkv.grad)
            v = Tensor(kv_bytes, qkv.grad) if self.cache else qkv
        else:
            q = self.linear(x, q_bytes, "self_attn.q_proj")
            k = self.linear(x, kv_bytes, "self_attn.k_proj")
            v = self.linear(x, kv_bytes, "self_attn.v_proj")
        if f.qk_norm:
            q, k = self.norm(q, d, heads), self.norm(k, d, kv_heads)
        q, k = self.rope(q), self.rope(k)
        if self.eager:
            out = self.eager_attention(q, k, v)
        else:
            out = Tensor(q_bytes, q.grad or k.grad or v.grad)
            if out.grad:
                self.keep(q, k, v, out, Tensor(4 * heads, False))
            if f.model_type in ROPE_CAT:
                out = Tensor(q_bytes, out.grad)
        return self.linear(out, 2 * s.hidden_size, "self_attn.o_proj")

    def eager_attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """transformers' eager_attention_forward: k and v repeated to every query head (a copy under GQA), the
        scores q·kᵀ (each matmul keeps the operand the other one's gradient needs), Gemma 2's soft cap (tanh keeps
        its 16-bit output), softmax in fp32 (keeps its output), its 16-bit cast (kept by the value matmul), and
        the output transposed into a copy for o_proj. Dropout at p = 0 keeps nothing."""
        s = self.spec
        heads, groups = s.num_attention_heads, s.num_attention_heads // s.num_key_value_heads
        if groups > 1:
            k, v = Tensor(q.nbytes, k.grad), Tensor(q.nbytes, v.grad)
        scores = self.mul(q, k, 2 * heads * self.keys)
        if s.attn_logit_softcapping:
            scores = self.unary(Tensor(scores.nbytes, scores.grad))  # tanh keeps its output, as SiLU its input
        if scores.grad:
            self.keep(Tensor(4 * heads * self.keys, False))
        probs = Tensor(scores.nbytes, scores.grad)
        out = self.mul(probs, v, q.nbytes)
        # its backward: the probabilities' 16-bit gradient and the fp32 softmax gradient beside the saved scores
        self.moments.append((self.bytes_per_token + 6 * heads * self.keys + 2 * s.hidden_size, self.fixed))
        return Tensor(q.nbytes, out.grad)

    def mlp(self, x: Tensor, width: int, prefix: str = "mlp") -> Tensor:
        """act(gate) * up, then down (Phi-3: gate and up are halves of one gate_up output, one storage)."""
        if self.family.fused_gate_up:
            gate = up = self.linear(x, 4 * width, f"{prefix}.gate_up_proj")
            act = Tensor(2 * width, gate.grad)
            if gate.grad:
                self.keep(gate)
            product = self.mul(up, act, 2 * width)
        else:
            gate = self.linear(x, 2 * width, f"{prefix}.gate_proj")
            up = self.linear(x, 2 * width, f"{prefix}.up_proj")
            product = self.mul(self.unary(gate), up)
        before = self.bytes_per_token
        out = self.linear(product, 2 * self.spec.hidden_size, f"{prefix}.down_proj")
        trained = self.roles.linear(f"{prefix}.down_proj") == "train"
        # Phi-3's LoRA'd gate_up: the moment is its backward, two more 16-bit input gradients (measured)
        fused = self.family.fused_gate_up and self.roles.linear(f"{prefix}.gate_up_proj") == "lora"
        self.mlp_moments(self.bytes_per_token - before, width, 2 * width * self.spec.hidden_size if trained else 0,
                         4 * self.spec.hidden_size if fused else 0)
        return out

    def mlp_moments(self, tail: float, width: float, weight_grad: float, extra: float = 0.0) -> None:
        """An MLP's backward peaks, `width` its intermediate values a token: while the gradient of its product meets
        those of act and up (6 bytes each, what down keeps already freed: `tail`), and while down's own backward
        builds its weight's gradient (`weight_grad` bytes, trained weights only) beside a 2-byte input gradient.
        Both beside the incoming 2h gradient (measured on the CPU's kernels, tests/fidelity)."""
        h = self.spec.hidden_size
        self.moments.append((self.bytes_per_token - tail + 6 * width + 2 * h + extra, self.fixed))
        if weight_grad:
            self.moments.append((self.bytes_per_token + 2 * width + 2 * h, self.fixed + weight_grad))

    def moe(self, x: Tensor) -> Tensor:
        """transformers 5's sparse block: a top-k router (a weight, not an nn.Linear: F.linear, softmax in fp32,
        topk), tokens sorted by expert and gathered (k slots a token, none dropped), one grouped GEMM for every
        expert's gate_up and one for down, the routing weight, the slots put back in token order and summed.
        Qwen2-MoE adds its shared expert, scaled by a sigmoid gate. A LoRA'd expert weight (`Roles.expert`) is the
        weight plus B·A, built whole in the forward and kept by its GEMM for the input's gradient (per layer)."""
        s = self.spec
        h, e, k, width = s.hidden_size, s.num_local_experts, s.num_experts_per_tok, s.moe_intermediate_size
        probs = Tensor(4 * e, self.weight(x, "router", e * h).grad)
        if probs.grad:
            self.keep(probs, Tensor(8 * k, False))  # softmax keeps its output, topk its indices
        fp32_weights = self.family.model_type in ROUTER_FP32_WEIGHTS
        if fp32_weights and probs.grad:  # Mixtral's in-place renormalisation keeps the top values and their sum
            self.keep(Tensor(4 * k, False), Tensor(4, False))
        weights = Tensor((4 if fp32_weights else 2) * k, probs.grad)
        if x.grad:
            self.keep(Tensor(8 * k, False))  # the gather's token indices
        if weights.grad:
            self.keep(Tensor(8 * k, False))  # the routing weights' gather indices
        slots = Tensor(2 * h * k, x.grad)
        gate_up = self.weight(slots, "gate_up", 2 * e * width * h, 4 * width * k)
        act = Tensor(2 * width * k, gate_up.grad)
        if gate_up.grad:
            self.keep(gate_up)
        product = self.mul(gate_up, act, 2 * width * k)
        before = self.bytes_per_token
        down = self.weight(product, "down", e * h * width, 2 * h * k)
        tail = self.bytes_per_token - before
        if gate_up.grad or down.grad:
            self.fixed += 4 * e  # the grouped GEMMs' int32 offsets (one tensor)
        weighted = self.mul(down, weights, (4 if fp32_weights else 2) * h * k)
        if weighted.grad:
            self.keep(Tensor(8 * k, False))  # the indices that put the slots back in token order
        trained = self.roles.expert("down") != "frozen"  # LoRA'd too: the gradient of the whole W + B·A
        self.mlp_moments(tail, width * k, 2 * e * h * width if trained else 0)
        # putting the slots back: the gradients of the weighted slots, their gather and their sum (measured)
        self.moments.append((self.bytes_per_token + 2 * h + 3 * weighted.nbytes, self.fixed))
        out = Tensor(2 * h, weighted.grad)
        if s.shared_expert_intermediate_size:
            shared = self.mlp(x, s.shared_expert_intermediate_size, "mlp.shared_expert")
            gate = self.linear(x, 2, "mlp.shared_expert_gate")
            sig = Tensor(2, gate.grad)
            if gate.grad:
                self.keep(sig)  # sigmoid keeps its output
            scaled = self.mul(sig, shared, 2 * h)
            out = Tensor(2 * h, out.grad or scaled.grad)
        return out

    def weight(self, x: Tensor, name: str, weights: int, out_bytes: float = 0.0) -> Tensor:
        """A matmul with an expert parameter (the router's F.linear, a grouped GEMM): trained or LoRA'd, it keeps
        its input; LoRA'd, also the 16-bit W + B·A if the input needs a gradient."""
        role = self.roles.expert(name)
        if role == "frozen":
            return Tensor(out_bytes, x.grad)
        self.keep(x)
        if role == "lora" and x.grad:
            self.fixed += 2 * weights
        return Tensor(out_bytes, True)

    def layer(self, x: Tensor, layer_type: str, mlp_half: bool = True) -> Tensor:
        """One decoder layer from its input; without `mlp_half`, its attention half (the "mlp" policy recomputes
        the rest from the half's output, 2h a token)."""
        f, h = self.family, self.spec.hidden_size
        y = self.attention(self.norm(x, h))
        if f.sandwich_norms:
            y = self.norm(y, h)
        x = Tensor(2 * h, x.grad or y.grad)
        if not mlp_half:
            self.keep(x)
            return x
        self.moments.append((self.bytes_per_token + NORM_BACKWARD * h, self.fixed))  # the MLP's norm, MLP freed
        y = self.norm(x, h)
        y = self.moe(y) if block_type(layer_type).has_experts else self.mlp(y, self.spec.intermediate_size)
        if f.sandwich_norms:
            y = self.norm(y, h)
            self.moments.append((self.bytes_per_token + LAST_NORM_BACKWARD * h, self.fixed))  # backward's first op
        return Tensor(2 * h, x.grad or y.grad)


def transformers_class(spec: ModelSpec) -> bool:
    """Whether transformers' own class runs this spec (a dense config.json planned as our MoE/MoD variant runs
    ours, as do presets and our exports)."""
    return spec.model_type in HF_TYPES and (spec.arch == "dense" or family_of(spec).experts != "none")


@lru_cache(maxsize=1024)
def layer_flow(spec: ModelSpec, layer_type: str, finetune: Finetune | None, input_grad: bool,
               mlp_half: bool = True, attention: str = "sdpa", seq_len: int = 0,
               cache: bool = True) -> tuple[float, float, bool, bool]:
    """(bytes per token, bytes per layer, whether its output needs a gradient, whether it reads the RoPE tables
    with a gradient) of one layer whose input does or does not need a gradient. Eager attention's scores make the
    bytes per token depend on the sequence (`seq_len` keys a query)."""
    flow = Flow(spec, Roles(spec, finetune), attention, seq_len, cache)
    out = flow.layer(Tensor(2 * spec.hidden_size, input_grad), layer_type, mlp_half)
    return flow.bytes_per_token, flow.fixed, out.grad, flow.reads_rope


@lru_cache(maxsize=1024)
def layer_backward_moments(spec: ModelSpec, layer_type: str, finetune: Finetune | None, input_grad: bool,
                           cache: bool = True, attention: str = "sdpa",
                           seq_len: int = 0) -> tuple[tuple[float, float], ...]:
    """The layer's own bytes (per token, per layer) at each peak of its backward: its saved tensors not yet freed
    and the gradients and temporaries the backward holds beside them (`Flow.mlp_moments`, `NORM_BACKWARD`)."""
    flow = Flow(spec, Roles(spec, finetune), attention, seq_len, cache)
    flow.layer(Tensor(2 * spec.hidden_size, input_grad), layer_type)
    return tuple(flow.moments)


@lru_cache(maxsize=256)
def head_flow(spec: ModelSpec, finetune: Finetune | None, input_grad: bool,
              loss: str | None = None) -> tuple[float, float, float]:
    """(bytes per token, per sequence, per step) outside the layers: the token ids (a trained embedding's
    backward), the final norm, the LM head's input (if it trains), Gemma 2's final tanh soft cap (its 16-bit
    output), the loss's fp32 log-softmax and targets; per sequence, the padded targets' extra row (transformers'
    loss shifts by padding the labels); per step, a Gemma norm's fp32 (1 + w). Another `loss` (activations.LOSSES)
    keeps its own bytes a logit, and what the loop holds, instead of the fp32 log-softmax."""
    roles = Roles(spec, finetune)
    flow = Flow(spec, roles)
    x = flow.norm(Tensor(2 * spec.hidden_size, input_grad), spec.hidden_size)
    logits = flow.linear(x, 2 * spec.vocab_size, "lm_head")  # never a LoRA target (all-linear leaves it out)
    if spec.final_logit_softcapping and logits.grad:
        flow.keep(Tensor(2 * spec.vocab_size, True))
    ids = 8 if roles.trains else 0
    if loss is None or loss == "transformers":
        return flow.bytes_per_token + ids + 4 * spec.vocab_size + 8, 8.0, flow.fixed
    impl = LOSSES[loss]
    return flow.bytes_per_token + ids + (impl.saved + impl.held) * spec.vocab_size + 8, 8.0, flow.fixed


__all__ = ["EXPERT_SITES", "FINAL_NORM_BACKWARD", "Flow", "LAST_NORM_BACKWARD", "MASK_BYTES", "NORM_BACKWARD", "Roles",
           "head_flow", "layer_backward_moments", "layer_flow", "peft_targets", "transformers_class"]
