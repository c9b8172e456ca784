"""Mixture-of-Depths routing (Raposo et al. 2024, arXiv 2404.02258).

A routed block sees only some tokens of each sequence; the rest ride the residual unchanged.

- Training ("topk"): a scalar router scores every token; per sequence exactly k = ceil(capacity * T)
  tokens are taken by `torch.topk` (T counts the row's real tokens, so padding changes neither k nor
  the choice), kept in sequence order, gathered, run through the block with their
  original RoPE positions and a causal mask among them, and their output *delta* is scaled by the
  router weight and scattered back. No Python loop over the batch.
- Inference ("causal"): top-k over the sequence looks ahead, so a token is routed iff its causal
  logit > 0 (sigmoid > 0.5): the router's own logit, or, with `mod_predictor_hidden_size`, a small
  predictor that reads a stop-gradient copy of the block input. Both are trained with BCE towards the
  top-k mask. Each sequence routes a different number of tokens, so they are gathered to the batch
  maximum, and the extra slots are masked out.

Router weight (`mod_router_weight`): sigmoid(r) by default. It is bounded, on the LM loss's gradient path,
and consistent with causal routing (a routed token has weight > 0.5). "logit" is the paper's raw r; "none"
(weight 1) makes a capacity-1.0 block exactly the dense block. The BCE loss uses the router logit without
detaching it, so the router learns from both losses; the predictor's input is detached.

KV cache: a routed layer caches keys only for the tokens it processed, with their slots (index in the
token stream the cache has seen) and a validity flag (`RoutedCacheLayer`). A skipped token is never a
key in that layer, cached or not, so generation with and without the cache agree. Causality among
routed tokens is decided on slots, not on position ids.

Attention maps (`output_attentions`): a routed layer returns the full [B, H, T, S] map of every token
against every key slot, with zero rows and columns for the tokens it skipped (`expand_routed_attention`),
so it lines up with the dense layers' maps.

Packed sequences (position ids that restart inside a row) are refused by the model: top-k over a packed
row would mix the sequences' routing budgets.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from adaptive.errors import AdaptiveError


class MoDStats(NamedTuple):
    bce_loss: torch.Tensor  # scalar fp32: router BCE (+ predictor BCE) towards the top-k mask
    skip_rate: torch.Tensor  # scalar fp32: fraction of (non-pad) tokens the block skipped
    router_agreement: torch.Tensor  # scalar fp32: fraction where (causal logit > 0) == top-k mask


class MoDPlan(NamedTuple):
    """Which tokens a routed block processes this call."""

    index: torch.Tensor  # [B, K] int64 sequence positions, ascending among the valid ones
    valid: torch.Tensor | None  # [B, K] bool; None when every slot is a real routed token
    weight: torch.Tensor  # [B, K] multiplier of the block's output delta (0 on invalid slots)
    stats: MoDStats


class MoDRouter(nn.Module):
    """The scalar router of a routed block, plus the optional causal predictor."""

    def __init__(self, hidden_size: int, predictor_hidden_size: int = 0):
        super().__init__()
        self.router = nn.Linear(hidden_size, 1, bias=False)
        self.predictor = None
        if predictor_hidden_size:
            self.predictor = nn.Sequential(
                nn.Linear(hidden_size, predictor_hidden_size, bias=False),
                nn.SiLU(),
                nn.Linear(predictor_hidden_size, 1, bias=False),
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Router logits [B, T] and predictor logits [B, T] (None without a predictor)."""
        logits = self.router(x).squeeze(-1)
        predicted = self.predictor(x.detach()).squeeze(-1) if self.predictor is not None else None
        return logits, predicted


def plan_routing(
    logits: torch.Tensor,
    predicted: torch.Tensor | None,
    capacity: float,
    mode: str,
    weight_fn: str,
    pad: torch.Tensor | None = None,
    width_group=None,
) -> MoDPlan:
    """Pick the tokens of a routed block. `mode` is "topk" or "causal"; `pad` [B, T] is True on padding.

    `width_group`: a process group whose ranks must gather the same number of slots in causal mode (DeepSpeed
    expert parallelism: every rank must enter the MoE all-to-all, also when it routed nothing itself).
    """
    batch, seq = logits.shape
    topk_index, topk_valid = _topk_per_row(logits, capacity, pad)
    topk_mask = torch.zeros_like(logits, dtype=torch.bool)
    topk_mask.scatter_(1, topk_index, True if topk_valid is None else topk_valid)
    causal_logits = predicted if predicted is not None else logits
    causal_mask = causal_logits > 0
    real = None if pad is None else ~pad

    if mode == "topk":
        index, valid = topk_index, topk_valid
        routed = topk_mask
    else:
        routed = causal_mask if real is None else causal_mask & real
        counts = routed.sum(dim=-1)
        width = counts.max()
        if width_group is not None:
            torch.distributed.all_reduce(width, op=torch.distributed.ReduceOp.MAX, group=width_group)
        width = min(int(width), seq)  # one host sync: the gathered width is data-dependent at inference
        position = torch.arange(seq, device=logits.device)
        # routed tokens first, each group in sequence order; the tail of each row is padding
        order = torch.argsort(torch.where(routed, position, position + seq), dim=-1)
        index = order[:, :width]
        valid = torch.arange(width, device=logits.device) < counts[:, None]

    weight = _router_weight(logits.gather(1, index), weight_fn)
    if valid is not None:
        weight = weight * valid

    target = topk_mask.float()
    bce = _masked_mean(F.binary_cross_entropy_with_logits(logits.float(), target, reduction="none"), real)
    if predicted is not None:
        bce = bce + _masked_mean(
            F.binary_cross_entropy_with_logits(predicted.float(), target, reduction="none"), real
        )
    stats = MoDStats(
        bce_loss=bce,
        skip_rate=1.0 - _masked_mean(routed.float(), real),
        router_agreement=_masked_mean((causal_mask == topk_mask).float(), real),
    )
    return MoDPlan(index, valid, weight, stats)


def _topk_per_row(
    logits: torch.Tensor, capacity: float, pad: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Top-k tokens of each row, k = ceil(capacity * real tokens of the row), in sequence order.

    Counting only real tokens keeps routing independent of how much padding a batch adds: with
    k = ceil(capacity * padded length) a short row would route every real token. Without padding the
    result is [B, k] with no validity mask. With padding, [B, K] with K = ceil(capacity * T) (a
    static width, so no host sync) and `valid` marking the first k of the row; the valid slots come
    first, each group in sequence order.
    """
    seq = logits.shape[1]
    width = min(seq, math.ceil(capacity * seq))
    if pad is None:
        return torch.topk(logits, width, dim=-1, sorted=False).indices.sort(dim=-1).values, None
    scores = logits.masked_fill(pad, torch.finfo(logits.dtype).min)
    top = torch.topk(scores, width, dim=-1, sorted=True).indices  # best first
    # the same float64 rounding as math.ceil(capacity * seq) above, so an unpadded row gets the same k
    k = torch.ceil((~pad).sum(dim=-1).double() * capacity).long()
    valid = torch.arange(width, device=logits.device) < k[:, None]
    order = torch.argsort(torch.where(valid, top, top + seq), dim=-1)
    return top.gather(1, order), valid.gather(1, order)


def _router_weight(logits: torch.Tensor, weight_fn: str) -> torch.Tensor:
    if weight_fn == "sigmoid":
        return torch.sigmoid(logits)
    if weight_fn == "logit":
        return logits
    return torch.ones_like(logits)


def _masked_mean(values: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    if keep is None:
        return values.mean()
    keep = keep.float()
    return (values * keep).sum() / keep.sum().clamp(min=1.0)


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, T, ...] -> [B, K, ...] at index [B, K]."""
    shape = (*index.shape, *x.shape[2:])
    return x.gather(1, index.view(*index.shape, *([1] * (x.dim() - 2))).expand(shape))


def scatter_delta(x: torch.Tensor, index: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """x + delta placed at index (indices are unique per row, so the add is exact)."""
    return x.scatter_add(1, index.unsqueeze(-1).expand_as(delta), delta)


def routed_attention_mask(
    query_slots: torch.Tensor, key_slots: torch.Tensor, key_valid: torch.Tensor | None
) -> torch.Tensor:
    """Boolean [B, 1, Q, K] mask for gathered tokens: a query sees valid keys at stream slots <= its own.

    The queries are the last Q keys; each always sees itself, so a padding slot never gets an empty row
    (its output is discarded, but an all-masked softmax would give NaN).
    """
    num_q, num_k = query_slots.shape[1], key_slots.shape[1]
    allowed = key_slots[:, None, :] <= query_slots[:, :, None]
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, :]
    own = torch.arange(num_k, device=allowed.device)[None, :] == (num_k - num_q + torch.arange(
        num_q, device=allowed.device))[:, None]
    return (allowed | own).unsqueeze(1)


def expand_routed_attention(
    weights: torch.Tensor,
    query_rows: torch.Tensor,
    query_valid: torch.Tensor | None,
    key_slots: torch.Tensor,
    key_valid: torch.Tensor | None,
    seq: int,
    kv_len: int,
) -> torch.Tensor:
    """Attention weights of gathered tokens [B, H, Q, K] -> the full map [B, H, seq, kv_len].

    `query_rows` [B, Q] are the queries' rows among this call's `seq` tokens, `key_slots` [B, K] the
    keys' stream slots. Skipped tokens get zero rows (they attended nothing here) and zero columns (no
    one attended to them); invalid slots contribute nothing.
    """
    batch, heads, num_q, num_k = weights.shape
    if query_valid is not None:
        weights = weights * query_valid[:, None, :, None]
    if key_valid is not None:
        weights = weights * key_valid[:, None, None, :]
    columns = weights.new_zeros(batch, heads, num_q, kv_len)
    columns.scatter_add_(3, key_slots[:, None, None, :].expand(batch, heads, num_q, num_k), weights)
    full = weights.new_zeros(batch, heads, seq, kv_len)
    return full.scatter_add_(2, query_rows[:, None, :, None].expand(batch, heads, num_q, kv_len), columns)


class RoutedCacheLayer(DynamicLayer):
    """KV cache of a routed layer: keys of processed tokens only, with their stream slots and validity.

    `slots` [B, L] holds each key's index in the token stream this cache has seen. `get_seq_length()`
    counts every token the model has seen (what position ids and the dense layers' masks need), not the
    number of cached keys; the layer may hold no keys at all while that count is above 0.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.slots: torch.Tensor | None = None
        self.key_valid: torch.Tensor | None = None
        self.seen_tokens = 0

    def append(self, keys, values, slots, valid):
        """Add this call's keys; returns all keys, values, slots [B, L], validity [B, L]."""
        if valid is None:
            valid = torch.ones_like(slots, dtype=torch.bool)
        keys, values = super().update(keys, values)
        if self.slots is None:
            self.slots, self.key_valid = slots, valid
        else:
            self.slots = torch.cat([self.slots, slots], dim=1)
            self.key_valid = torch.cat([self.key_valid, valid], dim=1)
        return keys, values, self.slots, self.key_valid

    def advance(self, num_tokens: int) -> None:
        self.seen_tokens += num_tokens

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def reset(self) -> None:
        super().reset()
        self.slots = self.key_valid = None
        self.seen_tokens = 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove == 0:
            return
        self.seen_tokens = max(0, self.seen_tokens + tokens_to_remove)
        if self.slots is None:
            return
        self.key_valid = self.key_valid & (self.slots < self.seen_tokens)
        keep = int(self.key_valid.any(dim=0).nonzero().max()) + 1 if self.key_valid.any() else 0
        self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]
        self.slots, self.key_valid = self.slots[:, :keep], self.key_valid[:, :keep]

    # The batch operations below act on stored keys only: DynamicLayer's versions test get_seq_length(),
    # which here counts tokens seen, and would index keys that a layer that routed nothing never stored.
    def _map_batch(self, fn) -> None:
        if self.slots is None:
            return
        self.keys, self.values, self.slots, self.key_valid = (
            fn(t) for t in (self.keys, self.values, self.slots, self.key_valid)
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices, ...])


def install_routed_cache_layers(cache: Cache, routed_layers: list[int], num_layers: int) -> None:
    """Give routed layers a RoutedCacheLayer inside a (possibly generate()-made) DynamicCache. Idempotent."""
    if not routed_layers or all(
        i < len(cache.layers) and isinstance(cache.layers[i], RoutedCacheLayer) for i in routed_layers
    ):
        return
    if not isinstance(cache, DynamicCache):
        raise AdaptiveError(
            f"MoD layers need a DynamicCache, got {type(cache).__name__}; use cache_implementation='dynamic'"
        )
    while len(cache.layers) < num_layers:
        cache.layers.append(DynamicLayer())
    for i in routed_layers:
        layer = cache.layers[i]
        if isinstance(layer, RoutedCacheLayer):
            continue
        if layer.get_seq_length() > 0:
            raise AdaptiveError(f"cache layer {i} already holds keys from a model without MoD routing")
        cache.layers[i] = RoutedCacheLayer()


__all__ = [
    "MoDRouter", "MoDPlan", "MoDStats", "plan_routing", "gather_tokens", "scatter_delta",
    "routed_attention_mask", "expand_routed_attention", "RoutedCacheLayer", "install_routed_cache_layers",
]
