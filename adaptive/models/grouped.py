"""Per-expert matmuls over Mixtral's 3D expert weights, in three layouts, with a hand-written backward.

Layouts (`counts`): None, a slot buffer x [E, C, K] run as one bmm; else rows x [N, K] sorted by expert,
`counts[e]` each, run as `torch._grouped_mm` (`grouped_mm`) or a per-expert loop of matmuls. On the CPU the
grouped_mm and the loop give bitwise-equal results (tests/models/test_moe.py).

Why a backward of our own (`GroupedLinearFunction`): autograd's grouped_mm and bmm backward compute a weight
gradient as x^T @ grad, shaped [E, in, out], and then copy its transpose into the weight's [E, out, in]
layout. grad^T @ x gives the weight's own layout directly, the matmul F.linear's backward runs per expert, and
on the CPU (torch 2.13, fp32) it ran in half the time (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import torch


def offsets(counts: list[int], device) -> torch.Tensor:
    """grouped_mm's `offs`: the end row of each group, int32."""
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def experts_matmul(x: torch.Tensor, weight: torch.Tensor, counts: list[int] | None, grouped_mm: bool):
    """x @ weight[e] per expert: x [E, C, K] (counts None) or [N, K] in groups; weight [E, K, M]."""
    if counts is None:
        return torch.bmm(x, weight)
    if grouped_mm:
        return torch._grouped_mm(x, weight, offs=offsets(counts, x.device))
    return torch.cat([part.mm(w) for part, w in zip(x.split(counts), weight.unbind(0))])


def experts_matmul_sum(a: torch.Tensor, weight_a: torch.Tensor, b: torch.Tensor, weight_b: torch.Tensor,
                       counts: list[int] | None):
    """a @ weight_a[e] + b @ weight_b[e] per expert (layouts as `experts_matmul`), the second product accumulated
    into the first by the matmul itself (baddbmm, addmm_): no separate pass for the sum. A loop for the groups:
    the lean experts use it in fp32, which grouped_mm runs only on the CPU, where it is itself a loop."""
    if counts is None:
        return torch.baddbmm(torch.bmm(a, weight_a), b, weight_b)
    out = a.new_empty(a.shape[0], weight_a.shape[-1])
    for part_a, part_b, w_a, w_b, target in zip(a.split(counts), b.split(counts), weight_a.unbind(0),
                                                weight_b.unbind(0), out.split(counts)):
        torch.mm(part_a, w_a, out=target).addmm_(part_b, w_b)
    return out


def experts_weight_grad(grad: torch.Tensor, x: torch.Tensor, counts: list[int] | None, grouped_mm: bool,
                        out: torch.Tensor | None = None):
    """The gradient of weight [E, M, K] in `x @ weight[e].T`: grad[e]^T @ x[e] per expert, in the weight's layout.
    `out` (a [E, M, K] view, e.g. one half of gate_up_proj's gradient) receives it in place; grouped_mm has no
    out=, so with `out` the groups run as a loop (its fp32 users reach grouped_mm only on the CPU, a loop too)."""
    if counts is None:
        return torch.bmm(grad.transpose(1, 2), x, out=out)
    if grouped_mm and out is None:
        return torch._grouped_mm(grad.t(), x, offs=offsets(counts, x.device))
    if out is None:
        return torch.stack([g.t().mm(part) for g, part in zip(grad.split(counts), x.split(counts))])
    for g, part, target in zip(grad.split(counts), x.split(counts), out.unbind(0)):
        torch.mm(g.t(), part, out=target)  # an empty group gives zeros
    return out


def expert_rows(values: torch.Tensor, counts: list[int] | None) -> torch.Tensor:
    """values [E, M] (a bias) broadcast to the layout: [E, 1, M] for the slot buffer, one row per grouped row."""
    if counts is None:
        return values[:, None, :]
    return values.repeat_interleave(torch.tensor(counts, device=values.device), dim=0)


def expert_sums(rows: torch.Tensor, counts: list[int] | None) -> torch.Tensor:
    """The transpose of `expert_rows`: each expert's rows summed, [E, M] (a bias's gradient)."""
    if counts is None:
        return rows.sum(1)
    experts = torch.arange(len(counts), device=rows.device).repeat_interleave(torch.tensor(counts, device=rows.device))
    return rows.new_zeros(len(counts), rows.shape[-1]).index_add_(0, experts, rows)


class GroupedLinearFunction(torch.autograd.Function):
    """x @ weight[e].T per expert (weight [E, out, in], the layout of gate_up_proj and down_proj). Saves x,
    as autograd does for a matmul."""

    @staticmethod
    def forward(ctx, x, weight, counts: list[int] | None, grouped_mm: bool):
        ctx.save_for_backward(x, weight)
        ctx.counts, ctx.grouped_mm = counts, grouped_mm
        return experts_matmul(x, weight.transpose(1, 2), counts, grouped_mm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = experts_matmul(grad, weight, ctx.counts, ctx.grouped_mm)
        if ctx.needs_input_grad[1]:
            grad_weight = experts_weight_grad(grad, x, ctx.counts, ctx.grouped_mm)
        return grad_x, grad_weight, None, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int] | None = None,
                   grouped_mm: bool = False) -> torch.Tensor:
    return GroupedLinearFunction.apply(x, weight, counts, grouped_mm)


__all__ = ["GroupedLinearFunction", "grouped_linear", "experts_matmul", "experts_matmul_sum", "experts_weight_grad",
           "expert_rows", "expert_sums", "offsets"]
