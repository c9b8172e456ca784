"""Mixture-of-Experts: one routing function, two dispatchers (native PyTorch here, DeepSpeed in
`moe_deepspeed.py`).

Both blocks have DeepSpeed's parameter names and shapes, so one state dict loads into either:

    deepspeed_moe.gate.wg.weight                                  [E, hidden]
    deepspeed_moe.gate.e_score_correction_bias                    [E] buffer, see below
    deepspeed_moe.experts.deepspeed_experts.{i}.{gate,up,down}_proj.weight

Routing follows DeepSpeed's top-1/top-2 gates (`deepspeed/moe/sharded_moe.py`) exactly when nothing
ties: softmax in fp32; top-2 weights renormalised over the routes that were kept; capacity
`max(ceil(tokens / E * capacity_factor * k), min_capacity)`; second choices queue behind all first
choices of an expert; tokens over capacity are dropped in token order; `l_aux = mean(me * ce) * E**2`
with `ce` from the first choice, before dropping; `exp_counts` counted before dropping. Random token
selection (DeepSpeed's `use_rts`) is off in both paths so they drop the same tokens.

`e_score_correction_bias` (DeepSeek-V3's aux-loss-free balancing) is added to the softmax scores for
*selection only*; combine weights and l_aux use the unbiased scores. It is a persistent buffer: it
changes routing, so a saved model must carry it. The name must not contain "expert": DeepSpeed's
checkpointing treats every such key as an expert weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class MoEStats(NamedTuple):
    """What one MoE layer reports per forward; all tensors, no host sync."""

    l_aux: torch.Tensor  # scalar fp32: load-balancing loss, DeepSpeed's definition
    z_loss: torch.Tensor  # scalar fp32: mean(logsumexp(router logits)^2)
    expert_counts: torch.Tensor  # [E] int64: routes per expert before dropping (DeepSpeed's exp_counts)
    dropped_fraction: torch.Tensor  # scalar fp32: dropped routes / (tokens * k)
    router_logits: torch.Tensor  # [tokens, E] fp32
    gate_entropy: torch.Tensor  # scalar fp32: mean over tokens of H(softmax(logits)) / log(E), in [0, 1]


class Routes(NamedTuple):
    experts: torch.Tensor  # [k, S] int64, -1 where the route was dropped
    locations: torch.Tensor  # [k, S] int64, slot inside the expert's capacity buffer
    weights: torch.Tensor  # [k, S] fp32 combine weights, 0 where dropped
    capacity: int | torch.Tensor  # a tensor only when drop_tokens=False (data-dependent)
    stats: MoEStats


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float, k: int, min_capacity: int) -> int:
    """DeepSpeed's `_capacity`: the product is taken in fp32, as there, so both round alike."""
    per_expert = torch.tensor(num_tokens / num_experts, dtype=torch.float32)
    capacity = math.ceil((per_expert * torch.tensor(capacity_factor * k, dtype=torch.float32)).item())
    return max(capacity, min_capacity)


def route(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float | None,
    min_capacity: int,
    selection_bias: torch.Tensor | None = None,
    sample_logits: torch.Tensor | None = None,
    second_expert_noise: bool = False,
    ep_group=None,
    used: torch.Tensor | None = None,
) -> Routes:
    """Top-k routing of `logits` [S, E] (fp32). `capacity_factor=None` drops nothing.

    `sample_logits` replaces the logits for the first choice (DeepSpeed's RSample policy);
    `second_expert_noise` samples the second choice with Gumbel noise (DeepSpeed's
    top2_2nd_expert_sampling). With `ep_group` and no dropping, the capacity is the max over the group,
    as every rank must send equal all-to-all chunks.

    `used` [S] bool marks real tokens (padding, MoD slots without a routed token are False): the others
    take no expert slot, get a zero output and stay out of the counts, losses and dropped fraction. The
    capacity still counts all S tokens, which keeps it free of host syncs. None = all tokens (DeepSpeed's
    exact math).
    """
    num_tokens, num_experts = logits.shape
    gates = logits.softmax(dim=-1)
    scores = gates if sample_logits is None else sample_logits.softmax(dim=-1)
    if selection_bias is not None:
        scores = scores + selection_bias.float()
    first = scores.argmax(dim=-1)
    mask1 = _one_hot(first, num_experts, used)
    choices, masks = [first], [mask1]
    if k == 2:
        second_scores = scores
        if second_expert_noise:
            noise = -torch.empty_like(logits).exponential_().log()  # Gumbel(0, 1)
            second_scores = (logits + noise).softmax(dim=-1) + (0 if selection_bias is None else selection_bias)
        second = second_scores.masked_fill(mask1.bool(), float("-inf")).argmax(dim=-1)
        choices.append(second)
        masks.append(_one_hot(second, num_experts, used))
    experts = torch.stack(choices)  # [k, S]

    first_counts = mask1.sum(dim=0)
    expert_counts = sum(m.sum(dim=0) for m in masks).detach()
    me = _token_mean(gates, used)
    ce = _token_mean(mask1.float(), used)
    l_aux = (me * ce).mean() * num_experts * num_experts
    z_loss = _token_mean(torch.logsumexp(logits, dim=-1).square(), used)
    # per-token router entropy, normalised: 1 = a uniform gate, 0 = one-hot; O(S·E), no host sync
    entropy = (_token_mean(torch.special.entr(gates.detach()).sum(dim=-1), used) / math.log(num_experts)).float()

    # Slot of each route in its expert's buffer: token order, second choices after all first choices.
    locations = torch.stack([
        (torch.cumsum(m, dim=0) - 1 + (first_counts if i else 0)).gather(1, c[:, None]).squeeze(1)
        for i, (m, c) in enumerate(zip(masks, choices))
    ])
    if capacity_factor is None:
        capacity = expert_counts.max()
        if ep_group is not None and torch.distributed.get_world_size(ep_group) > 1:
            torch.distributed.all_reduce(capacity, op=torch.distributed.ReduceOp.MAX, group=ep_group)
        kept = torch.ones_like(experts, dtype=torch.bool)
    else:
        capacity = expert_capacity(num_tokens, num_experts, capacity_factor, k, min_capacity)
        kept = locations < capacity
    if used is not None:
        kept = kept & used

    weights = gates.gather(1, experts.t()).t() * kept  # [k, S]
    if k == 2:
        weights = weights / weights.sum(dim=0, keepdim=True).clamp(min=torch.finfo(weights.dtype).eps)
    dropped = 1.0 - (kept.sum() / (k * _count(used, num_tokens))).float()
    stats = MoEStats(l_aux, z_loss, expert_counts, dropped, logits, entropy)
    return Routes(experts.masked_fill(~kept, -1), locations * kept, weights, capacity, stats)


def _one_hot(choice: torch.Tensor, num_experts: int, used: torch.Tensor | None) -> torch.Tensor:
    mask = F.one_hot(choice, num_experts)
    return mask if used is None else mask * used[:, None]


def _count(used: torch.Tensor | None, num_tokens: int):
    return num_tokens if used is None else used.sum().clamp(min=1)


def _token_mean(values: torch.Tensor, used: torch.Tensor | None) -> torch.Tensor:
    if used is None:
        return values.mean(dim=0)
    weights = used.to(values.dtype).view(-1, *([1] * (values.dim() - 1)))
    return (values * weights).sum(dim=0) / _count(used, values.shape[0])


class MoEGate(nn.Module):
    """Router weights plus the routing knobs. Native twin of DeepSpeed's `TopKGate`."""

    def __init__(self, hidden_size: int, num_experts: int, k: int, capacity_factor: float,
                 eval_capacity_factor: float | None, min_capacity: int, drop_tokens: bool,
                 noisy_gate_policy: str | None, top2_2nd_expert_sampling: bool):
        super().__init__()
        self.wg = nn.Linear(hidden_size, num_experts, bias=False)
        _init_gate_state(self, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity, drop_tokens,
                         noisy_gate_policy, top2_2nd_expert_sampling)

    def forward(self, x: torch.Tensor, ep_group=None, used: torch.Tensor | None = None) -> Routes:
        return gate_routes(self, x, ep_group, used)


def _init_gate_state(gate: nn.Module, num_experts: int, k: int, capacity_factor: float,
                     eval_capacity_factor: float | None, min_capacity: int, drop_tokens: bool,
                     noisy_gate_policy: str | None, top2_2nd_expert_sampling: bool) -> None:
    gate.num_experts = num_experts
    gate.k = k
    gate.capacity_factor = capacity_factor
    gate.eval_capacity_factor = eval_capacity_factor
    gate.min_capacity = min_capacity
    gate.drop_tokens = drop_tokens
    gate.noisy_gate_policy = noisy_gate_policy
    gate.top2_2nd_expert_sampling = top2_2nd_expert_sampling
    gate.register_buffer("e_score_correction_bias", torch.zeros(num_experts), persistent=True)


def gate_routes(gate: nn.Module, x: torch.Tensor, ep_group=None, used: torch.Tensor | None = None) -> Routes:
    """Shared forward of the native and DeepSpeed gates: x [S, hidden] (and `used` [S]) -> Routes."""
    x = x.float()
    policy = gate.noisy_gate_policy if gate.training else None
    if policy == "Jitter":
        x = x * torch.empty_like(x).uniform_(1.0 - 1e-2, 1.0 + 1e-2)
    logits = F.linear(x, gate.wg.weight.float())
    sample = None
    if policy == "RSample" and gate.k == 1:
        sample = logits - torch.empty_like(logits).exponential_().log()
    factor = gate.capacity_factor if gate.training else gate.eval_capacity_factor
    if not gate.drop_tokens:
        factor = None
    return route(logits, gate.k, factor, gate.min_capacity, gate.e_score_correction_bias, sample,
                 gate.top2_2nd_expert_sampling and gate.k == 2, ep_group, used)


class Experts(nn.Module):
    """`num_experts` experts, under DeepSpeed's attribute name.

    Built fresh from `make_expert` rather than deep-copied (DeepSpeed's way): weights are initialised by
    `_init_weights` anyway, and deep copies of fake parameters keep every gradient alive under
    `FakeTensorMode`, which would skew `adaptive measure`.
    """

    def __init__(self, make_expert: Callable[[], nn.Module], num_experts: int):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([make_expert() for _ in range(num_experts)])


class NativeMoELayer(nn.Module):
    def __init__(self, gate: MoEGate, experts: Experts):
        super().__init__()
        self.gate = gate
        self.experts = experts


class NativeMoE(nn.Module):
    """Pure-PyTorch MoE block with DeepSpeed's parameter layout. forward(x) -> (y, MoEStats).

    Two dispatchers produce the same result:
    - training with drop_tokens: a fixed [E * capacity] slot buffer, the same layout DeepSpeed
      all-to-alls. Its size follows from the token count alone, so there is no host sync;
    - otherwise (eval, or no dropping): tokens sorted by expert into exact-size groups. One host sync
      per layer for the group sizes, and no compute on empty slots (decode steps have few tokens).
    """

    def __init__(self, hidden_size: int, make_expert: Callable[[], nn.Module], num_experts: int, k: int,
                 capacity_factor: float, eval_capacity_factor: float | None, min_capacity: int, drop_tokens: bool,
                 noisy_gate_policy: str | None, top2_2nd_expert_sampling: bool):
        super().__init__()
        gate = MoEGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                       drop_tokens, noisy_gate_policy, top2_2nd_expert_sampling)
        self.deepspeed_moe = NativeMoELayer(gate, Experts(make_expert, num_experts))
        self.num_experts = num_experts

    @property
    def gate(self) -> MoEGate:
        return self.deepspeed_moe.gate

    def forward(self, hidden_states: torch.Tensor, used: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEStats]:
        """hidden_states [..., hidden]; `used` [...] bool marks real tokens (see `route`)."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        routes = self.gate(x, used=None if used is None else used.reshape(-1))
        experts = self.deepspeed_moe.experts.deepspeed_experts
        if self.training and isinstance(routes.capacity, int):
            out = _dispatch_slots(x, routes, experts)
        else:
            out = _dispatch_grouped(x, routes, experts)
        return out.view_as(hidden_states), routes.stats


def _combine(rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_k weights[k, s] * rows[slots[k, s]]; rows has a trailing zero row for dropped routes."""
    k, num_tokens = slots.shape
    routed = rows.index_select(0, slots.reshape(-1)).view(k, num_tokens, -1)
    return (routed * weights.unsqueeze(-1)).sum(dim=0).to(dtype)  # fp32 accumulation, as DeepSpeed


def _dispatch_slots(x: torch.Tensor, routes: Routes, experts: nn.ModuleList) -> torch.Tensor:
    num_tokens, hidden = x.shape
    capacity, num_experts = routes.capacity, len(experts)
    total = num_experts * capacity
    slots = torch.where(routes.experts >= 0, routes.experts * capacity + routes.locations, total)
    # Invert the map (slot -> source token) so filling the buffer is one gather; empty slots read a zero row.
    source = torch.full((total + 1,), num_tokens, dtype=torch.long, device=x.device)
    token_ids = torch.arange(num_tokens, device=x.device).expand_as(slots)
    source.scatter_(0, slots.reshape(-1), token_ids.reshape(-1))
    padded = torch.cat([x, x.new_zeros(1, hidden)])
    buffer = padded.index_select(0, source[:total]).view(num_experts, capacity, hidden)
    outputs = [expert(buffer[e]) for e, expert in enumerate(experts)]
    rows = torch.cat([*outputs, x.new_zeros(1, hidden)]).view(total + 1, hidden)
    return _combine(rows, slots, routes.weights, x.dtype)


def _dispatch_grouped(x: torch.Tensor, routes: Routes, experts: nn.ModuleList) -> torch.Tensor:
    k, num_tokens = routes.experts.shape
    num_experts = len(experts)
    flat = routes.experts.reshape(-1)
    key = torch.where(flat >= 0, flat, num_experts)  # dropped routes sort last
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts].tolist()  # the one host sync
    kept = sum(counts)
    tokens = (order[:kept] % num_tokens)
    groups = x.index_select(0, tokens).split(counts)
    # empty groups run too: their experts then get zero (not None) gradients, which DDP/ZeRO expect
    outputs = [expert(g) for expert, g in zip(experts, groups)]
    rows = torch.cat([*outputs, x.new_zeros(1, x.shape[1])])
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=x.device)
    slots = torch.where(flat >= 0, rank, kept).view(k, num_tokens)
    return _combine(rows, slots, routes.weights, x.dtype)


__all__ = ["MoEStats", "Routes", "route", "expert_capacity", "MoEGate", "NativeMoE", "Experts"]
