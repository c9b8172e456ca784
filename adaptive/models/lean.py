"""Memory-lean blocks: the same values as the plain blocks, fewer bytes saved for backward.

Each is a `torch.autograd.Function` that saves only its 16-bit inputs (plus fp32 1/rms for RMSNorm)
and recomputes the rest in backward; the forward runs the plain block's ops in the plain block's
order, so outputs and the loss are the same values (the loss up to the order of an fp32 sum).

What autograd keeps per token, plain -> lean (h hidden, f SwiGLU width, V vocabulary):

- RMSNorm: fp32 copy of x (4h), 1/rms (4), 16-bit cast (2h) -> x (2h) and 1/rms (4);
- SwiGLU + down projection: gate, silu(gate), up, product (8f) -> gate and up (4f); the product is
  recomputed for the down projection's weight gradient. The MoE experts (3D weights, Mixtral's layout) do
  the same per expert: their gate and up (4f) are kept, not silu(gate) and the product (`ExpertsSwiGLUFunction`);
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

from adaptive.models.grouped import (
    expert_rows,
    expert_sums,
    experts_matmul,
    experts_matmul_sum,
    experts_weight_grad,
)
from adaptive.plan.estimate.losses import loss_chunk_tokens

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


class ExpertsSwiGLUFunction(torch.autograd.Function):
    """The experts' SwiGLU MLP in Mixtral's 3D layout, bias of the down projection excluded: per expert e,
    down[e] @ (silu(gate) * up), gate and up being x times the halves of gate_up_proj[e] (plus their bias).
    Saves x, gate and up (4f per row, as `SwiGLUDownFunction`); the product is recomputed.

    gate and up are two matmuls into contiguous tensors, not one [rows, 2I] output split into strided halves:
    on the CPU an elementwise pass over a strided half cost as much as over the whole row (torch 2.13, fp32:
    silu 7.1 ms on a half of [4096, 1408], 3.6 ms on a contiguous [4096, 704]), and forward and backward make
    seven such passes. The matmuls' work is the same; the gate_up gradient is filled half by half.

    Layouts (`counts`): None, a slot buffer x [E, C, H] run as bmm; else rows x [N, H] sorted by expert,
    `counts[e]` each, run as `torch._grouped_mm` (`grouped_mm`) or a per-expert loop of matmuls
    (`grouped.experts_matmul`). gate_up [E, 2I, H], down [E, H, I], gate_up_bias [E, 2I] or None.
    """

    @staticmethod
    def forward(ctx, x, gate_up, down, gate_up_bias, counts: list[int] | None, grouped_mm: bool):
        width = down.shape[-1]
        gate = experts_matmul(x, gate_up[:, :width].transpose(1, 2), counts, grouped_mm)
        up = experts_matmul(x, gate_up[:, width:].transpose(1, 2), counts, grouped_mm)
        if gate_up_bias is not None:
            gate.add_(expert_rows(gate_up_bias[:, :width], counts))
            up.add_(expert_rows(gate_up_bias[:, width:], counts))
        ctx.save_for_backward(x, gate, up, gate_up, down)
        ctx.counts, ctx.grouped_mm, ctx.has_bias = counts, grouped_mm, gate_up_bias is not None
        return experts_matmul(F.silu(gate).mul_(up), down.transpose(1, 2), counts, grouped_mm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, gate, up, gate_up, down = ctx.saved_tensors
        counts, grouped_mm, width = ctx.counts, ctx.grouped_mm, down.shape[-1]
        # Where the gradients go. fp32/fp64: two contiguous tensors, and each matmul over gate_up runs as two
        # half-width ones (strided halves cost a CPU block step 4-7%, 2 threads, 8-64 experts; an fp32 sum in two
        # halves rounds like one). 16-bit: one [rows, 2I] tensor, so the input gradient is one matmul (two would
        # round each half's sum) and no copy joins the halves.
        if gate.element_size() >= 4:
            rows, grad_up = None, F.silu(gate)
        else:
            rows = gate.new_empty(*gate.shape[:-1], 2 * width)
            grad_up = torch.ops.aten.silu.out(gate, out=rows[..., width:])
        # silu becomes grad_up in place; beside it the working set is the product, then grad_product in its place
        grad_down = None
        if ctx.needs_input_grad[2]:
            product = torch.mul(grad_up, up)
            grad_down = experts_weight_grad(grad, product, counts, grouped_mm)
            del product
        grad_product = experts_matmul(grad, down, counts, grouped_mm)
        grad_up.mul_(grad_product)  # silu * grad_product
        grad_gate = grad_product if rows is None else rows[..., :width]
        torch.ops.aten.silu_backward.grad_input(grad_product.mul_(up), gate, grad_input=grad_gate)
        del grad_product
        grad_x = grad_gate_up = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = (experts_matmul(rows, gate_up, counts, grouped_mm) if rows is not None else
                      experts_matmul_sum(grad_gate, gate_up[:, :width], grad_up, gate_up[:, width:], counts))
        if ctx.needs_input_grad[1]:
            if rows is not None:
                grad_gate_up = experts_weight_grad(rows, x, counts, grouped_mm)
            else:
                grad_gate_up = gate_up.new_empty(gate_up.shape)
                experts_weight_grad(grad_gate, x, counts, grouped_mm, out=grad_gate_up[:, :width])
                experts_weight_grad(grad_up, x, counts, grouped_mm, out=grad_gate_up[:, width:])
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = (expert_sums(rows, counts) if rows is not None else
                         torch.cat([expert_sums(grad_gate, counts), expert_sums(grad_up, counts)], dim=-1))
        return grad_x, grad_gate_up, grad_down, grad_bias, None, None


def experts_swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                   counts: list[int] | None = None, grouped_mm: bool = False) -> torch.Tensor:
    return ExpertsSwiGLUFunction.apply(x, gate_up, down, gate_up_bias, counts, grouped_mm)


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


__all__ = ["RMSNormFunction", "SwiGLUFunction", "SwiGLUDownFunction", "ExpertsSwiGLUFunction",
           "ChunkedLMLossFunction", "LeanSwiGLUDown", "LeanLMHead", "rms_norm", "swiglu", "experts_swiglu",
           "lean_causal_lm_loss", "shift_labels"]
