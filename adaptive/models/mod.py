"""Mixture-of-Depths routing (Raposo et al. 2024, arXiv 2404.02258).

A routed block sees only some tokens of each sequence; the rest ride the residual unchanged.

- Training ("topk"): a scalar router scores every token; per sequence exactly k = ceil(capacity * T)
  tokens are taken by `torch.topk`, kept in sequence order, gathered, run through the block with their
  original RoPE positions and a causal mask among them, and their output *delta* is scaled by the
  router weight and scattered back. No Python loop over the batch.
- Inference ("causal"): top-k over the sequence looks ahead, so a token is routed iff its causal
  logit > 0 (sigmoid > 0.5): the router's own logit, or, with `mod_predictor_hidden_size`, a small
  predictor that reads a stop-gradient copy of the block input. Both are trained with BCE towards the
  top-k mask. Each sequence routes a different number of tokens, so they are gathered to the batch
  maximum, and the extra slots are masked out.

KV cache: a routed layer caches keys only for the tokens it processed, with their positions and a
validity flag (`RoutedCacheLayer`). A skipped token is never a key in that layer, cached or not, so
generation with and without the cache agree.
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
) -> MoDPlan:
    """Pick the tokens of a routed block. `mode` is "topk" or "causal"; `pad` [B, T] is True on padding."""
    batch, seq = logits.shape
    k = min(seq, math.ceil(capacity * seq))
    scores = logits if pad is None else logits.masked_fill(pad, torch.finfo(logits.dtype).min)
    topk_index = torch.topk(scores, k, dim=-1, sorted=False).indices
    topk_mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, topk_index, True)
    causal_logits = predicted if predicted is not None else logits
    causal_mask = causal_logits > 0
    real = None if pad is None else ~pad

    if mode == "topk":
        index = topk_index.sort(dim=-1).values
        valid = None if pad is None else real.gather(1, index)
        routed = topk_mask if real is None else topk_mask & real
    else:
        routed = causal_mask if real is None else causal_mask & real
        counts = routed.sum(dim=-1)
        width = int(counts.max())  # one host sync: the gathered width is data-dependent at inference
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
    query_positions: torch.Tensor, key_positions: torch.Tensor, key_valid: torch.Tensor | None
) -> torch.Tensor:
    """Boolean [B, 1, Q, K] mask for gathered tokens: a query sees valid keys at positions <= its own.

    The queries are the last Q keys; each always sees itself, so a padding slot never gets an empty row
    (its output is discarded, but an all-masked softmax would give NaN).
    """
    num_q, num_k = query_positions.shape[1], key_positions.shape[1]
    allowed = key_positions[:, None, :] <= query_positions[:, :, None]
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, :]
    own = torch.arange(num_k, device=allowed.device)[None, :] == (num_k - num_q + torch.arange(
        num_q, device=allowed.device))[:, None]
    return (allowed | own).unsqueeze(1)


class RoutedCacheLayer(DynamicLayer):
    """KV cache of a routed layer: keys of processed tokens only, with their positions and validity.

    `get_seq_length()` counts every token the model has seen (what position ids and the dense layers'
    masks need), not the number of cached keys.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.positions: torch.Tensor | None = None
        self.key_valid: torch.Tensor | None = None
        self.seen_tokens = 0

    def append(self, keys, values, positions, valid):
        """Add this call's keys; returns all keys, values, positions [B, L], validity [B, L]."""
        if valid is None:
            valid = torch.ones_like(positions, dtype=torch.bool)
        keys, values = super().update(keys, values)
        if self.positions is None:
            self.positions, self.key_valid = positions, valid
        else:
            self.positions = torch.cat([self.positions, positions], dim=1)
            self.key_valid = torch.cat([self.key_valid, valid], dim=1)
        return keys, values, self.positions, self.key_valid

    def advance(self, num_tokens: int) -> None:
        self.seen_tokens += num_tokens

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def reset(self) -> None:
        super().reset()
        self.positions = self.key_valid = None
        self.seen_tokens = 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove == 0:
            return
        self.seen_tokens = max(0, self.seen_tokens + tokens_to_remove)
        if self.positions is None:
            return
        self.key_valid = self.key_valid & (self.positions < self.seen_tokens)
        keep = int(self.key_valid.any(dim=0).nonzero().max()) + 1 if self.key_valid.any() else 0
        self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]
        self.positions, self.key_valid = self.positions[:, :keep], self.key_valid[:, :keep]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.positions is not None:
            self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))
            self.key_valid = self.key_valid.index_select(0, beam_idx.to(self.key_valid.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.positions is not None:
            self.positions = self.positions.repeat_interleave(repeats, dim=0)
            self.key_valid = self.key_valid.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.positions is not None:
            self.positions, self.key_valid = self.positions[indices], self.key_valid[indices]


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
    "routed_attention_mask", "RoutedCacheLayer", "install_routed_cache_layers",
]
