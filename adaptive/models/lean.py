"""Memory-lean blocks: the same values as the plain blocks, fewer bytes saved for backward.

Each is a `torch.autograd.Function` that saves only its 16-bit inputs (plus fp32 1/rms for RMSNorm)
and recomputes the rest in backward; the forward runs the plain block's ops in the plain block's
order, so outputs and the loss are the same values (the loss up to the order of an fp32 sum).

What autograd keeps per token, plain -> lean (h hidden, f SwiGLU width, V vocabulary):

- RMSNorm: fp32 copy of x (4h), 1/rms (4), 16-bit cast (2h) -> x (2h) and 1/rms (4);
- SwiGLU + down projection: gate, silu(gate), up, product (8f) -> gate and up (4f); the product is
  recomputed for the down projection's weight gradient. The MoE experts (3D weights, Mixtral's layout) do
  the same per expert: their gate_up output (4f) is kept, not its halves' products (`ExpertsSwiGLUDownFunction`);
- LM head + loss: the fp32 log-softmax over the vocabulary (4V), and in backward the fp32 logit
  gradients with their 16-bit cast (8V more) -> nothing V-wide kept; a tile of `loss_chunk_tokens`
  tokens' logits exists at a time, in forward and again (recomputed) in backward.

Why not DeepSpeed's tiled pieces (`deepspeed.runtime.sequence_parallel.ulysses_sp`, 0.19):
`TiledFusedLogitsLoss` runs the lm_head's backward inside forward with an assumed upstream gradient
of 1 and only rescales the input gradient afterwards, so the lm_head weight gradient ignores what
really flows in (gradient-accumulation scaling, the fp16 loss scale, `loss + aux_loss`); its "mean"
over tiles is wrong when tiles hold different numbers of unmasked labels. `TiledMLP` tiles the whole
MLP over the sequence and recomputes all of it (three matmuls) in backward: it bounds the working set
at long sequences but saves the same bytes per token as the plain MLP. So the Functions are ours.

The modules (`LeanSwiGLUDown`, `LeanLMHead`) are `nn.Linear` subclasses called as modules, so
DeepSpeed ZeRO-3 gathers their weights in its module hooks as it does for any linear layer, and their
state-dict keys are those of the plain layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from adaptive.models.grouped import experts_matmul, experts_weight_grad
from adaptive.plan.activations import loss_chunk_tokens

IGNORE_INDEX = -100  # transformers' ignore index for labels


class RMSNormFunction(torch.autograd.Function):
    """y = weight * (x·rsqrt(mean(x²) + eps)).to(x.dtype); saves x and 1/rms only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            # the plain path's mul backward: grad * normed (in the product's dtype), summed to weight's shape
            grad_weight = (grad * normed.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = (grad * weight).to(x.dtype).float()  # through the 16-bit cast, as autograd does
            grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
            grad_x = grad_x.to(x.dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps)


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up; saves gate and up. For expert layouts whose down projection is not a linear
    module (grouped 3D weights): the down matmul then keeps the product (6f per token instead of 8f)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        return _swiglu_input_grads(grad, gate, up, F.silu(gate))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return SwiGLUFunction.apply(gate, up)


def _swiglu_input_grads(grad_product, gate, up, silu):
    """The plain path's mul and silu backward, op for op: the same values."""
    grad_up = grad_product * silu
    grad_gate = torch.ops.aten.silu_backward(grad_product * up, gate)
    return grad_gate, grad_up


class SwiGLUDownFunction(torch.autograd.Function):
    """down(silu(gate) * up) with the down weight [H, F]; saves gate and up, recomputes the product."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias):
        ctx.save_for_backward(gate, up, weight)
        ctx.has_bias = bias is not None
        return F.linear(F.silu(gate) * up, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        silu = F.silu(gate)
        product = silu * up
        flat_grad = grad.reshape(-1, grad.shape[-1])
        w = weight.to(grad.dtype)  # under autocast the forward ran in the activations' dtype
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[2]:
            grad_weight = flat_grad.t().mm(product.reshape(-1, product.shape[-1]).to(grad.dtype)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = flat_grad.sum(0)
        grad_product = flat_grad.mm(w).view(product.shape).to(product.dtype)
        grad_gate, grad_up = _swiglu_input_grads(grad_product, gate, up, silu)
        return grad_gate, grad_up, grad_weight, grad_bias


class ExpertsSwiGLUDownFunction(torch.autograd.Function):
    """The experts' SwiGLU and down projection in Mixtral's 3D layout: per expert e, down[e] applied to
    silu(gate) * up, where `gate_up` holds gate then up on its last dimension (the output of the experts'
    gate_up_proj). Saves gate_up only (4f per row, as `SwiGLUDownFunction`); the product is recomputed.

    Layouts (`counts`): None, a slot buffer gate_up [E, C, 2I] run as one bmm; else rows gate_up [N, 2I]
    sorted by expert, `counts[e]` each, run as `torch._grouped_mm` (`grouped_mm`) or a per-expert loop of
    matmuls (`grouped.experts_matmul`). weight is down_proj [E, H, I].
    """

    @staticmethod
    def forward(ctx, gate_up, weight, counts: list[int] | None, grouped_mm: bool):
        gate, up = gate_up.chunk(2, dim=-1)
        ctx.save_for_backward(gate_up, weight)
        ctx.counts, ctx.grouped_mm = counts, grouped_mm
        return experts_matmul(F.silu(gate).mul_(up), weight.transpose(1, 2), counts, grouped_mm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate_up, weight = ctx.saved_tensors
        counts, grouped_mm = ctx.counts, ctx.grouped_mm
        gate, up = gate_up.chunk(2, dim=-1)
        # The halves of grad_gate_up serve as scratch first: silu in grad_up's half, the product (for the weight
        # gradient) in grad_gate's. So the working set is grad_gate_up and grad_product only, and no [rows, I]
        # tensor is allocated per intermediate (on the CPU a fresh 10-100 MB buffer costs page faults comparable
        # to the elementwise work). The input gradients (`_swiglu_input_grads`' math) are then written in place:
        # no concatenation copy (plain's chunk backward has one).
        grad_gate_up = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_gate_up = torch.empty_like(gate_up)
            grad_gate, grad_up = grad_gate_up.chunk(2, dim=-1)
            silu = torch.ops.aten.silu.out(gate, out=grad_up)
        else:
            silu = F.silu(gate)
        if ctx.needs_input_grad[1]:
            product = silu.mul_(up) if grad_gate_up is None else torch.mul(silu, up, out=grad_gate)
            grad_weight = experts_weight_grad(grad, product, counts, grouped_mm)
            del product
        if grad_gate_up is not None:
            grad_product = experts_matmul(grad, weight, counts, grouped_mm)
            grad_up.mul_(grad_product)  # silu * grad_product
            torch.mul(grad_product, up, out=grad_gate)
            torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_gate_up, grad_weight, None, None


def experts_swiglu_down(gate_up: torch.Tensor, weight: torch.Tensor, counts: list[int] | None = None,
                        grouped_mm: bool = False) -> torch.Tensor:
    return ExpertsSwiGLUDownFunction.apply(gate_up, weight, counts, grouped_mm)


class LeanSwiGLUDown(nn.Linear):
    """The down projection of a SwiGLU MLP. `forward(gate, up)` is down(silu(gate) * up) through
    `SwiGLUDownFunction`; `forward(x)` is the plain linear layer."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        if up is None:
            return super().forward(gate)
        return SwiGLUDownFunction.apply(gate, up, self.weight, self.bias)


class ChunkedLMLossFunction(torch.autograd.Function):
    """Sum over tokens of cross_entropy(hidden @ weight.T in fp32, labels), `chunk` tokens at a time.

    hidden [N, h] (16-bit), weight [V, h], labels [N] (already shifted; IGNORE_INDEX skipped). Saves
    hidden and labels (hidden is the final norm's output, which the plain lm_head keeps too); backward
    recomputes each tile's logits. The weight gradient is accumulated tile by tile in the weight's dtype.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[start:start + chunk], weight).float()
            total = total + F.cross_entropy(logits, labels[start:start + chunk], ignore_index=IGNORE_INDEX,
                                            reduction="sum")
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight, labels = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        w = weight.to(hidden.dtype)
        for start in range(0, hidden.shape[0], ctx.chunk):
            h, y = hidden[start:start + ctx.chunk], labels[start:start + ctx.chunk]
            probs = F.linear(h, w).float().softmax(-1)
            valid = y != IGNORE_INDEX
            rows = torch.arange(y.shape[0], device=y.device)
            probs[rows, y.clamp(min=0)] -= 1.0
            probs.mul_((grad * valid).unsqueeze(-1))  # ignored rows get no gradient
            grad_logits = probs.to(hidden.dtype)  # the plain path's logits are 16-bit: its gradient is too
            del probs
            if need_hidden:
                grad_hidden[start:start + ctx.chunk] = grad_logits.mm(w)
            if need_weight:
                grad_weight.addmm_(grad_logits.t().to(grad_weight.dtype), h.to(grad_weight.dtype))
            del grad_logits  # before the next tile's logits exist
        return grad_hidden, grad_weight, None, None


class LeanLMHead(nn.Linear):
    """The LM head. `forward(hidden)` gives logits; `forward(hidden, labels=...)` gives the summed
    token losses of the shifted labels without materialising the logits (`ChunkedLMLossFunction`);
    `shifted_labels=` takes labels shifted already (a sequence-parallel shard's)."""

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None,
                shifted_labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None and shifted_labels is None:
            return super().forward(hidden)
        flat = hidden.reshape(-1, hidden.shape[-1])
        targets = shifted_labels if shifted_labels is not None else shift_labels(labels)
        targets = targets.reshape(-1).to(hidden.device)
        return ChunkedLMLossFunction.apply(flat, self.weight, targets, loss_chunk_tokens(self.out_features))


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """transformers' shift: position t predicts labels[t + 1]; the last position predicts nothing."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def lean_causal_lm_loss(head: LeanLMHead, hidden: torch.Tensor, labels: torch.Tensor | None,
                        num_items_in_batch: int | torch.Tensor | None = None,
                        shifted_labels: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' ForCausalLMLoss (shift once, or take `shifted_labels` as they are; ignore -100; mean
    over real labels or sum / num_items_in_batch) through the chunked head."""
    total = head(hidden, labels, shifted_labels)
    if num_items_in_batch is None:
        targets = shifted_labels if shifted_labels is not None else shift_labels(labels)
        num_items_in_batch = (targets != IGNORE_INDEX).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


__all__ = ["RMSNormFunction", "SwiGLUFunction", "SwiGLUDownFunction", "ExpertsSwiGLUDownFunction",
           "ChunkedLMLossFunction", "LeanSwiGLUDown", "LeanLMHead", "rms_norm", "swiglu", "experts_swiglu_down",
           "lean_causal_lm_loss", "shift_labels"]
