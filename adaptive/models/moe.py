"""Mixture-of-Experts: one routing function, two dispatchers (native PyTorch here, DeepSpeed in
`moe_deepspeed.py`).

The native block has transformers' Mixtral layout, which is also the checkpoint layout:

    gate.weight                       [E, hidden]
    gate.e_score_correction_bias      [E] buffer, see below
    experts.gate_up_proj              [E, 2 * I, hidden]   gate rows first, then up (Mixtral's order)
    experts.down_proj                 [E, hidden, I]
    experts.{gate_up,down}_proj_bias  [E, 2 * I], [E, hidden]   only with mlp_bias

DeepSpeed's block keeps DeepSpeed's names (`deepspeed_moe.gate.wg.weight`,
`deepspeed_moe.experts.deepspeed_experts.{i}.{gate,up,down}_proj.weight`); `to_deepspeed_layout` and
`from_deepspeed_layout` convert state dicts between the two, so one checkpoint loads into either block.

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
import re
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from adaptive.models.grouped import expert_rows, grouped_linear
from adaptive.models.lean import experts_swiglu


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
    with torch.no_grad():  # selection and counting need no gradient: argmax, sort and counts
        scores = gates.detach() if sample_logits is None else sample_logits.softmax(dim=-1)
        if selection_bias is not None:
            scores = scores + selection_bias.float()
        first = scores.argmax(dim=-1)
        choices = [first]
        if k == 2:
            second_scores = scores
            if second_expert_noise:
                noise = -torch.empty_like(logits).exponential_().log()  # Gumbel(0, 1)
                second_scores = (logits + noise).softmax(dim=-1) + (0 if selection_bias is None else selection_bias)
            # the first choice is out (for unused tokens too: their routes are masked below whatever they pick)
            choices.append(second_scores.scatter(1, first[:, None], float("-inf")).argmax(dim=-1))
        experts = torch.stack(choices)  # [k, S]

        # Counts and slots without [S, E] one-hot masks: routes of unused tokens take the key E (counted apart).
        key = experts if used is None else experts.masked_fill(~used, num_experts)
        counts = torch.zeros(k, num_experts + 1, dtype=torch.long, device=logits.device)
        counts.scatter_add_(1, key, torch.ones_like(key))
        first_counts, expert_counts = counts[0, :num_experts], counts[:, :num_experts].sum(dim=0)
        # Slot of each route in its expert's buffer: its rank among the expert's routes in the order first
        # choices by token, then second choices by token (a stable sort of the flat [k * S] keys).
        flat = key.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=order.device)
        totals = counts.sum(dim=0)
        locations = (rank - (torch.cumsum(totals, dim=0) - totals)[flat]).view(k, num_tokens)
        ce = first_counts.float() / _count(used, num_tokens)  # the mean over tokens of the first choices' one-hot

    me = _token_mean(gates, used)
    l_aux = (me * ce).mean() * num_experts * num_experts
    lse = torch.logsumexp(logits, dim=-1)
    z_loss = _token_mean(lse.square(), used)
    with torch.no_grad():
        # per-token router entropy, normalised: 1 = a uniform gate, 0 = one-hot; O(S·E), no host sync.
        # H = -sum p log p = logsumexp(logits) - sum p * logits: no log of p (0 where p underflows)
        per_token = (lse - (gates * logits).sum(dim=-1)).clamp(min=0)
        entropy = (_token_mean(per_token, used) / math.log(num_experts)).float()

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
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))  # Mixtral's router weight
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
    weight = gate.weight if isinstance(gate, MoEGate) else gate.wg.weight  # DeepSpeed's TopKGate: wg
    logits = F.linear(x, weight.float())
    sample = None
    if policy == "RSample" and gate.k == 1:
        sample = logits - torch.empty_like(logits).exponential_().log()
    factor = gate.capacity_factor if gate.training else gate.eval_capacity_factor
    if not gate.drop_tokens:
        factor = None
    return route(logits, gate.k, factor, gate.min_capacity, gate.e_score_correction_bias, sample,
                 gate.top2_2nd_expert_sampling and gate.k == 2, ep_group, used)


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts as 3D tensors (transformers' MixtralExperts layout).

    Two ways to run them, both exact per expert (the matmuls and their backward: `grouped.grouped_linear`):
    - `batched(buffer [E, C, hidden])`: one batched matmul over a fixed slot buffer (training with capacity);
    - `grouped(x [N, hidden], counts)`: tokens sorted by expert into contiguous groups, run as two
      `torch._grouped_mm` calls where its kernel takes them (CUDA in bf16, CPU in fp32, rows 16-byte
      aligned); else an exact loop of per-expert matmuls. On CPU both give bitwise-equal outputs and
      gradients (tests/models/test_moe.py).

    `lean` (silu only): the experts run through `lean.ExpertsSwiGLUFunction`, which keeps gate and up (4f per
    row) instead of gate, silu(gate), up and their product (8f); same values.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False,
                 act: str = "silu", lean: bool = False):
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size)) if bias else None
        self.act_fn = ACT2FN[act]
        self.lean = lean and act == "silu"

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def batched(self, buffer: torch.Tensor) -> torch.Tensor:
        """buffer [E, C, hidden] -> [E, C, hidden]: expert e on row block e."""
        return self._run(buffer, None, False)

    def grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [N, hidden] sorted by expert, `counts[e]` rows each -> [N, hidden]."""
        return self._run(x, counts, _use_grouped_mm(x, self.gate_up_proj.shape[-1], self.intermediate_size))

    def _run(self, x: torch.Tensor, counts: list[int] | None, grouped_mm: bool) -> torch.Tensor:
        # Every expert's weights enter the graph, empty groups too: DDP/ZeRO expect a gradient for each.
        if self.lean:
            out = experts_swiglu(x, self.gate_up_proj, self.down_proj, self.gate_up_proj_bias, counts, grouped_mm)
        else:
            h = grouped_linear(x, self.gate_up_proj, counts, grouped_mm)
            if self.gate_up_proj_bias is not None:
                h = h + expert_rows(self.gate_up_proj_bias, counts)
            out = grouped_linear(self._swiglu(h), self.down_proj, counts, grouped_mm)
        return out if self.down_proj_bias is None else out + expert_rows(self.down_proj_bias, counts)


def _use_grouped_mm(x: torch.Tensor, hidden: int, intermediate: int) -> bool:
    """Whether torch._grouped_mm's kernels take these operands: bf16 on CUDA, fp32 on CPU, 16-byte aligned rows."""
    if not hasattr(torch, "_grouped_mm") or not GROUPED_MM_ENABLED:
        return False
    dtype = {"cuda": torch.bfloat16, "cpu": torch.float32}.get(x.device.type)
    per_16_bytes = 16 // x.element_size()
    return x.dtype == dtype and hidden % per_16_bytes == 0 and intermediate % per_16_bytes == 0


GROUPED_MM_ENABLED = True  # False: always the per-expert loop (tests compare the two)


class NativeMoE(nn.Module):
    """Pure-PyTorch MoE block in Mixtral's layout (`gate`, `experts`). forward(x) -> (y, MoEStats).

    Two dispatchers produce the same result:
    - training with drop_tokens: a fixed [E, capacity] slot buffer, the same layout DeepSpeed
      all-to-alls, run as one batched matmul. Its size follows from the token count alone, so there is
      no host sync;
    - otherwise (eval, or no dropping): tokens sorted by expert into exact-size groups. One host sync
      per layer for the group sizes, and no compute on empty slots (decode steps have few tokens).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, k: int,
                 capacity_factor: float, eval_capacity_factor: float | None, min_capacity: int, drop_tokens: bool,
                 noisy_gate_policy: str | None, top2_2nd_expert_sampling: bool, bias: bool = False,
                 act: str = "silu", lean: bool = False):
        super().__init__()
        self.gate = MoEGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                            drop_tokens, noisy_gate_policy, top2_2nd_expert_sampling)
        self.experts = GroupedExperts(num_experts, hidden_size, intermediate_size, bias, act, lean)
        self.num_experts = num_experts
        convert_on_load(self, to_deepspeed=False)  # DeepSpeed-named weights load too

    def forward(self, hidden_states: torch.Tensor, used: torch.Tensor | None = None) -> tuple[torch.Tensor, MoEStats]:
        """hidden_states [..., hidden]; `used` [...] bool marks real tokens (see `route`)."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        routes = self.gate(x, used=None if used is None else used.reshape(-1))
        if self.training and isinstance(routes.capacity, int):
            out = _dispatch_slots(x, routes, self.experts)
        else:
            out = _dispatch_grouped(x, routes, self.experts)
        return out.view_as(hidden_states), routes.stats


# Gathers are `tensor[index]`, not `index_select`: on CPU the backward of index_select is a scatter_add that
# ran ~30x slower than index's accumulating index_put (torch 2.13, profiled against Mixtral's block).

def _combine(rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_k weights[k, s] * rows[slots[k, s]] (dropped routes point at a zero row of `rows`, or have weight 0)."""
    k, num_tokens = slots.shape
    routed = rows[slots.reshape(-1)].view(k, num_tokens, -1)
    return (routed * weights.unsqueeze(-1)).sum(dim=0).to(dtype)  # fp32 accumulation, as DeepSpeed


def _dispatch_slots(x: torch.Tensor, routes: Routes, experts: GroupedExperts) -> torch.Tensor:
    num_tokens, hidden = x.shape
    capacity, num_experts = routes.capacity, experts.num_experts
    total = num_experts * capacity
    slots = torch.where(routes.experts >= 0, routes.experts * capacity + routes.locations, total)
    # Invert the map (slot -> source token) so filling the buffer is one gather; empty slots read a zero row.
    source = torch.full((total + 1,), num_tokens, dtype=torch.long, device=x.device)
    token_ids = torch.arange(num_tokens, device=x.device).expand_as(slots)
    source.scatter_(0, slots.reshape(-1), token_ids.reshape(-1))
    padded = torch.cat([x, x.new_zeros(1, hidden)])
    buffer = padded[source[:total]].view(num_experts, capacity, hidden)
    rows = torch.cat([experts.batched(buffer).reshape(total, hidden), x.new_zeros(1, hidden)])
    return _combine(rows, slots, routes.weights, x.dtype)


def _dispatch_grouped(x: torch.Tensor, routes: Routes, experts: GroupedExperts) -> torch.Tensor:
    k, num_tokens = routes.experts.shape
    num_experts = experts.num_experts
    flat = routes.experts.reshape(-1)
    key = torch.where(flat >= 0, flat, num_experts)  # dropped routes sort last
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts].tolist()  # the one host sync
    kept = sum(counts)
    rows = experts.grouped(x[order[:kept] % num_tokens], counts)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=x.device)
    if kept < order.numel():  # dropped routes (eval capacity, padding) read a zero row
        rows = torch.cat([rows, x.new_zeros(1, x.shape[1])])
        rank = torch.where(flat >= 0, rank, kept)
    return _combine(rows, rank.view(k, num_tokens), routes.weights, x.dtype)


# ---------------------------------------------------------------------------------------------
# Layout converter: our (Mixtral) checkpoint layout <-> DeepSpeed's module names

_NATIVE_KEY = re.compile(r"^(.*?)(gate\.weight|gate\.e_score_correction_bias|experts\.(?:gate_up_proj|down_proj)(?:_bias)?)$")
_DEEPSPEED_KEY = re.compile(
    r"^(.*?)deepspeed_moe\.(?:gate\.(wg\.weight|e_score_correction_bias)|"
    r"experts\.deepspeed_experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias))$"
)


def convert_on_load(module: nn.Module, to_deepspeed: bool) -> None:
    """Let `module.load_state_dict` (and its parents') take an MoE block's weights in either layout."""

    def hook(_module, state_dict, prefix, *args) -> None:
        own = {k[len(prefix):]: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)]}
        own = to_deepspeed_layout(own, block_only=True) if to_deepspeed else from_deepspeed_layout(own)
        state_dict.update({prefix + k: v for k, v in own.items()})

    module.register_load_state_dict_pre_hook(hook)


def is_deepspeed_key(key: str) -> bool:
    return _DEEPSPEED_KEY.match(key) is not None


def from_deepspeed_layout(state_dict: dict) -> dict:
    """DeepSpeed-named MoE entries -> the native (Mixtral) layout; every other entry passes through."""
    out, experts = {}, {}
    for key, value in state_dict.items():
        match = _DEEPSPEED_KEY.match(key)
        if match is None:
            out[key] = value
        elif match.group(2) == "wg.weight":
            out[f"{match.group(1)}gate.weight"] = value
        elif match.group(2):
            out[f"{match.group(1)}gate.e_score_correction_bias"] = value
        else:
            experts.setdefault(match.group(1), {})[(int(match.group(3)), match.group(4), match.group(5))] = value
    for prefix, parts in experts.items():
        num = 1 + max(e for e, _, _ in parts)
        for kind in ("weight", "bias"):
            if not any(part[2] == kind for part in parts):
                continue
            if any((e, proj, kind) not in parts for e in range(num) for proj in ("gate_proj", "up_proj", "down_proj")):
                continue  # an incomplete layer stays unconverted: the loader then reports what is missing
            suffix = "" if kind == "weight" else "_bias"
            out[f"{prefix}experts.gate_up_proj{suffix}"] = torch.stack(
                [torch.cat([parts[(e, "gate_proj", kind)], parts[(e, "up_proj", kind)]]) for e in range(num)])
            out[f"{prefix}experts.down_proj{suffix}"] = torch.stack([parts[(e, "down_proj", kind)] for e in range(num)])
    return out


def to_deepspeed_layout(state_dict: dict, block_only: bool = False) -> dict:
    """Native (Mixtral-layout) MoE entries -> DeepSpeed's names; every other entry passes through.

    Only keys under an `mlp.` module are MoE entries (an attention `gate` would not be), unless `block_only`
    says the dict is one MoE block's own."""
    out = {}
    for key, value in state_dict.items():
        match = None if _DEEPSPEED_KEY.match(key) else _NATIVE_KEY.match(key)
        if match is None or not (block_only or match.group(1).endswith("mlp.")):
            out[key] = value
            continue
        prefix, name = match.group(1) + "deepspeed_moe.", match.group(2)
        if name == "gate.weight":
            out[prefix + "gate.wg.weight"] = value
        elif name == "gate.e_score_correction_bias":
            out[prefix + name] = value
        else:
            kind = "bias" if name.endswith("_bias") else "weight"
            for e in range(value.shape[0]):
                expert = f"{prefix}experts.deepspeed_experts.{e}."
                if name.startswith("experts.gate_up_proj"):
                    gate, up = value[e].chunk(2, dim=0)
                    out[f"{expert}gate_proj.{kind}"], out[f"{expert}up_proj.{kind}"] = gate, up
                else:
                    out[f"{expert}down_proj.{kind}"] = value[e]
    return out


__all__ = ["MoEStats", "Routes", "route", "expert_capacity", "MoEGate", "NativeMoE", "GroupedExperts",
           "from_deepspeed_layout", "to_deepspeed_layout", "is_deepspeed_key", "convert_on_load"]
