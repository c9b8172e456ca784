"""Adaptive decoder: Llama-style blocks (RMSNorm, RoPE, GQA, SwiGLU, SDPA) whose MLP may be an MoE
(`moe.py`, `moe_deepspeed.py`) and whose whole block may be MoD-routed (`mod.py`), per
`config.block_types`. Reads top-down: norm, rotary, MLP, attention, decoder layer, outputs,
PreTrainedModel, model, ForCausalLM.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.utils.checkpoint
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel, slice_logits_to_keep
from transformers.utils import ModelOutput, can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg

from adaptive.errors import AdaptiveError
from adaptive.models.configuration_adaptive import AdaptiveConfig
from adaptive.models.lean import LeanLMHead, LeanSwiGLUDown, lean_causal_lm_loss, rms_norm
from adaptive.models.mod import (
    MoDRouter,
    MoDStats,
    expand_routed_attention,
    gather_tokens,
    install_routed_cache_layers,
    plan_routing,
    routed_attention_mask,
    scatter_delta,
)
from adaptive.models.moe import (
    GroupedExperts,
    MoEGate,
    MoEStats,
    NativeMoE,
    from_deepspeed_layout,
    is_deepspeed_key,
    to_deepspeed_layout,
)
from adaptive.plan.architecture.blocks import block_type

logger = logging.get_logger(__name__)


class AdaptiveRMSNorm(nn.Module):
    """`lean`: the same values through `lean.RMSNormFunction`, which saves x and 1/rms only."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, lean: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.lean = lean

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.lean:
            return rms_norm(hidden_states, self.weight, self.variance_epsilon)
        dtype = hidden_states.dtype
        hidden_states = hidden_states.float()
        hidden_states = hidden_states * torch.rsqrt(hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)


class AdaptiveRotaryEmbedding(nn.Module):
    def __init__(self, config: AdaptiveConfig):
        super().__init__()
        self.config = config
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        rope_init_fn = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: AdaptiveConfig, **kwargs) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0

    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class AdaptiveMLP(nn.Module):
    """SwiGLU. Also the expert module of the MoE blocks. `lean` (silu only): the down projection
    recomputes silu(gate) * up in backward instead of keeping it (`lean.SwiGLUDownFunction`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, act: str = "silu",
                 lean: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = LeanSwiGLUDown(intermediate_size, hidden_size, bias=bias)
        self.act_fn = ACT2FN[act]
        self.lean = lean and act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # AutoTP (tensor parallelism) swaps the down projection for its row-parallel layer, which takes one input
        if self.lean and isinstance(self.down_proj, LeanSwiGLUDown):
            return self.down_proj(self.gate_proj(x), self.up_proj(x))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return hidden_states
    batch, heads, seq, dim = hidden_states.shape
    return hidden_states[:, :, None].expand(batch, heads, n_rep, seq, dim).reshape(batch, heads * n_rep, seq, dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class RoutedKeys(NamedTuple):
    """Where the gathered tokens of a routed layer sit, and which are real."""

    rows: torch.Tensor  # [B, K] int64: row among this call's `seq` tokens
    slots: torch.Tensor  # [B, K] int64: index in the token stream the cache has seen (rows + past tokens)
    valid: torch.Tensor | None  # [B, K] bool, None = all valid
    plain_causal: bool  # sorted, all valid, no cache: the gathered tokens need only a causal mask
    seq: int  # tokens in this call


class AdaptiveAttention(nn.Module):
    def __init__(self, config: AdaptiveConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        q_dim, kv_dim = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=config.o_bias)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, routed=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *position_embeddings)

        if routed is None:
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)
        else:
            key, value, attention_mask, key_slots, key_valid, kv_len = self._routed_keys_and_mask(
                routed, key, value, cache, query.dtype
            )

        interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        output, weights = interface(
            self, query, key, value, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs,
        )
        if routed is not None and weights is not None and kwargs.get("output_attentions"):
            weights = expand_routed_attention(weights, routed.rows, routed.valid, key_slots, key_valid, routed.seq,
                                              kv_len)
        return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights

    def _routed_keys_and_mask(self, routed: RoutedKeys, key, value, cache, dtype):
        """Keys/values (cached ones first), the mask, and the keys' slots, validity and total count
        (tokens seen, routed or not: the width of the full attention map) for a routed layer."""
        sdpa = self.config._attn_implementation == "sdpa"
        if cache is None:
            kv_len = routed.seq
            if routed.plain_causal and sdpa:  # SDPA's is_causal on the gathered, stream-sorted tokens
                return key, value, None, routed.slots, routed.valid, kv_len
            key_slots, key_valid = routed.slots, routed.valid
        else:
            layer = cache.layers[self.layer_idx]
            kv_len = layer.seen_tokens + routed.seq
            key, value, key_slots, key_valid = layer.append(key, value, routed.slots, routed.valid)
        mask = routed_attention_mask(routed.slots, key_slots, key_valid)
        if not sdpa:  # eager adds the mask to the scores
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
        return key, value, mask, key_slots, key_valid, kv_len


class LayerOutput(NamedTuple):
    moe: MoEStats | None
    mod: MoDStats | None
    attention: torch.Tensor | None


def build_mlp(config: AdaptiveConfig, layer_type: str) -> nn.Module:
    lean = config.kernels == "lean"
    if not block_type(layer_type).has_experts:
        return AdaptiveMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, config.hidden_act, lean)

    knobs = dict(
        capacity_factor=config.capacity_factor, eval_capacity_factor=config.eval_capacity_factor,
        min_capacity=config.min_capacity, drop_tokens=config.drop_tokens,
        noisy_gate_policy=config.noisy_gate_policy, top2_2nd_expert_sampling=config.top2_2nd_expert_sampling,
    )
    if config.moe_implementation == "deepspeed":
        # lean as the native grouped experts: both implementations hold the same bytes
        expert = AdaptiveMLP(config.hidden_size, config.moe_intermediate_size, config.mlp_bias, config.hidden_act, lean)
        return _moe_deepspeed().DeepSpeedMoE(config.hidden_size, expert, config.num_local_experts,
                                             config.num_experts_per_tok, config.ep_size, **knobs)
    return NativeMoE(config.hidden_size, config.moe_intermediate_size, config.num_local_experts,
                     config.num_experts_per_tok, **knobs, bias=config.mlp_bias, act=config.hidden_act,
                     lean=lean)


class AdaptiveDecoderLayer(GradientCheckpointingLayer):
    """Attention + (SwiGLU | MoE); MoD-routed when block_types[layer_idx] is "mod" or "hybrid"."""

    def __init__(self, config: AdaptiveConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.block_types[layer_idx]
        self.self_attn = AdaptiveAttention(config, layer_idx)
        self.mlp = build_mlp(config, self.layer_type)
        lean = config.kernels == "lean"
        self.input_layernorm = AdaptiveRMSNorm(config.hidden_size, eps=config.rms_norm_eps, lean=lean)
        self.post_attention_layernorm = AdaptiveRMSNorm(config.hidden_size, eps=config.rms_norm_eps, lean=lean)
        kind = block_type(self.layer_type)
        self.is_moe = kind.has_experts
        routed = kind.routed
        self.mod = MoDRouter(config.hidden_size, config.mod_predictor_hidden_size) if routed else None
        self.checkpoint_mlp = False  # selective checkpointing: recompute the MLP half (checkpointing.py)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        padding_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, LayerOutput]:
        if self.mod is None:
            # the attention gets the position ids, as Llama's does: Ulysses sequence parallelism gathers them
            out, moe, attn = self._block(hidden_states, position_embeddings, attention_mask, cache, None,
                                         padding_mask, position_ids=position_ids, **kwargs)
            return out, LayerOutput(moe, None, attn)
        return self._routed_forward(hidden_states, position_ids, cache, position_embeddings, padding_mask, **kwargs)

    def _block(self, hidden_states, position_embeddings, attention_mask, cache, routed, used, **kwargs):
        """The block's output, its MoE stats and attention weights. A routed block (`routed` given) returns
        its output *delta* (attention + MLP), which the router weight scales; a plain one returns
        `(x + attention) + MLP`, added in Llama's order so that exported models give bitwise-equal logits.

        `used` [B, T] marks real tokens for the MoE (padding and empty MoD slots take no expert capacity).
        """
        attn, weights = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache, routed, **kwargs
        )
        residual = hidden_states + attn
        if self.checkpoint_mlp and self.training and torch.is_grad_enabled():
            # keeps only the MLP half's input; its norm and MLP (or MoE) run again in backward
            mlp_out, moe = torch.utils.checkpoint.checkpoint(self._mlp_half, residual, used, use_reentrant=False)
        else:
            mlp_out, moe = self._mlp_half(residual, used)
        return (attn + mlp_out if routed is not None else residual + mlp_out), moe, weights

    def _mlp_half(self, residual: torch.Tensor, used: torch.Tensor | None):
        mlp_in = self.post_attention_layernorm(residual)
        if self.is_moe:
            return self.mlp(mlp_in, used)
        return self.mlp(mlp_in), None

    def _expert_parallel_group(self):
        """The EP group of a hybrid layer's DeepSpeed MoE (ep_size > 1), else None."""
        if not self.is_moe or self.config.ep_size == 1:
            return None
        return getattr(self.mlp.deepspeed_moe, "ep_group", None)

    def _routing_mode(self) -> str:
        mode = self.config.mod_routing
        return ("topk" if self.training else "causal") if mode == "auto" else mode

    def _routed_forward(self, hidden_states, position_ids, cache, position_embeddings, padding_mask, **kwargs):
        batch, seq, _ = hidden_states.shape
        mode = self._routing_mode()
        logits, predicted = self.mod(hidden_states)
        pad = None if padding_mask is None else ~padding_mask
        plan = plan_routing(logits, predicted, self.config.mod_capacity, mode, self.config.mod_router_weight, pad,
                            self._expert_parallel_group())
        layer_cache = cache.layers[self.layer_idx] if cache is not None else None
        past = layer_cache.seen_tokens if layer_cache is not None else 0
        if plan.index.shape[1] == 0:  # causal routing chose no token in the whole batch
            if layer_cache is not None:
                layer_cache.advance(seq)
            moe = _empty_moe_stats(self.config, hidden_states.device) if self.is_moe else None
            attn = None
            if kwargs.get("output_attentions"):  # nothing attended: an all-zero map of the usual shape
                attn = hidden_states.new_zeros(batch, self.config.num_attention_heads, seq, past + seq)
            return hidden_states, LayerOutput(moe, plan.stats, attn)

        cos, sin = (gather_tokens(t.expand(batch, seq, -1), plan.index) for t in position_embeddings)
        plain_causal = mode == "topk" and cache is None and plan.valid is None
        routed = RoutedKeys(plan.index, plan.index + past, plan.valid, plain_causal, seq)
        selected = gather_tokens(hidden_states, plan.index)
        delta, moe, attn = self._block(selected, (cos, sin), None, cache, routed, plan.valid, **kwargs)
        if layer_cache is not None:
            layer_cache.advance(seq)
        out = scatter_delta(hidden_states, plan.index, delta * plan.weight.unsqueeze(-1).to(delta.dtype))
        return out, LayerOutput(moe, plan.stats, attn)


def _empty_moe_stats(config: AdaptiveConfig, device) -> MoEStats:
    zero = torch.zeros((), device=device)
    counts = torch.zeros(config.num_local_experts, dtype=torch.long, device=device)
    return MoEStats(zero, zero, counts, zero, torch.zeros(0, config.num_local_experts, device=device), zero)


@dataclass
class AdaptiveRouterStats(ModelOutput):
    """Router statistics of one forward, stacked per routed layer; tensors stay on the device.

    Row i of the MoE fields is layer `moe_layers[i]`, row j of the MoD fields layer `mod_layers[j]`.
    With DeepSpeed expert parallelism the counts are this rank's tokens.
    """

    expert_counts: torch.Tensor | None = None  # [L_moe, E] int64, before dropping
    dropped_fraction: torch.Tensor | None = None  # [L_moe]
    load_balancing_loss: torch.Tensor | None = None  # [L_moe], unweighted l_aux
    z_loss: torch.Tensor | None = None  # [L_moe], unweighted
    router_entropy: torch.Tensor | None = None  # [L_moe], mean per-token gate entropy / log(E)
    mod_skip_rate: torch.Tensor | None = None  # [L_mod]
    mod_router_agreement: torch.Tensor | None = None  # [L_mod]: (causal logit > 0) == top-k mask
    mod_bce_loss: torch.Tensor | None = None  # [L_mod], unweighted
    moe_layers: tuple[int, ...] | None = None
    mod_layers: tuple[int, ...] | None = None


@dataclass
class AdaptiveModelOutputWithPast(ModelOutput):
    last_hidden_state: torch.Tensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    aux_loss: torch.Tensor | None = None
    router_stats: AdaptiveRouterStats | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None


@dataclass
class AdaptiveCausalLMOutputWithPast(ModelOutput):
    """Like transformers' MoeCausalLMOutputWithPast, plus router statistics.

    Field order follows transformers' causal LM outputs: `outputs[0]` is the loss when labels are given,
    else the logits (`aux_loss` comes after the attentions, so it is never first).
    `loss` = LM loss + `aux_loss` (when labels are given). `past_key_values` still reads `cache`.
    `aux_loss` = router_aux_loss_coef * mean l_aux + router_z_loss_coef * mean z-loss over MoE layers
    + mod_aux_loss_coef * mean BCE over MoD layers; None for a dense model.
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    aux_loss: torch.Tensor | None = None
    router_stats: AdaptiveRouterStats | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None


def _collect_router_stats(config: AdaptiveConfig, outputs: list[LayerOutput]):
    moe = [o.moe for o in outputs if o.moe is not None]
    mod = [o.mod for o in outputs if o.mod is not None]
    if not moe and not mod:
        return None, None
    stats = AdaptiveRouterStats(moe_layers=tuple(config.moe_layers), mod_layers=tuple(config.mod_layers))
    if moe:
        stats.expert_counts = torch.stack([m.expert_counts for m in moe])
        stats.dropped_fraction = torch.stack([m.dropped_fraction for m in moe])
        stats.load_balancing_loss = torch.stack([m.l_aux for m in moe])
        stats.z_loss = torch.stack([m.z_loss for m in moe])
        stats.router_entropy = torch.stack([m.gate_entropy for m in moe])
    if mod:
        stats.mod_skip_rate = torch.stack([m.skip_rate for m in mod])
        stats.mod_router_agreement = torch.stack([m.router_agreement for m in mod])
        stats.mod_bce_loss = torch.stack([m.bce_loss for m in mod])
    aux = router_aux_loss(config, stats.load_balancing_loss.mean() if moe else None,
                          stats.z_loss.mean() if moe else None, stats.mod_bce_loss.mean() if mod else None)
    return aux, stats


def router_aux_loss(config: AdaptiveConfig, load_balancing: torch.Tensor | None, z_loss: torch.Tensor | None,
                    mod_bce: torch.Tensor | None) -> torch.Tensor | float:
    """The routers' term of the loss from their per-layer means (None: no such layers): each mean times its
    coefficient. One place for the pipelined model too (pipeline.py)."""
    aux = 0.0
    if load_balancing is not None:
        aux = aux + config.router_aux_loss_coef * load_balancing
        if config.router_z_loss_coef:
            aux = aux + config.router_z_loss_coef * z_loss
    if mod_bce is not None:
        aux = aux + config.mod_aux_loss_coef * mod_bce
    return aux


class AdaptivePreTrainedModel(PreTrainedModel):
    _expert_parallel_ready = False
    config: AdaptiveConfig
    config_class = AdaptiveConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["AdaptiveDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False  # routed layers need an arbitrary boolean mask
    _supports_flex_attn = False
    _supports_attention_backend = False
    _can_compile_fullgraph = False  # MoD causal routing and grouped MoE dispatch are data-dependent
    # MoE weights in the other block's layout (and other ranks' experts under EP) are loaded by `from_pretrained`
    # itself (`_load_moe_weights`), which checks that every MoE weight was found.
    _keys_to_ignore_on_load_unexpected = [r"deepspeed_moe\.", r"mlp\.experts\.", r"mlp\.gate\.(weight|e_score)"]
    _keys_to_ignore_on_load_missing = [r"deepspeed_moe\.", r"mlp\.experts\.", r"mlp\.gate\.(weight|e_score)"]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, GroupedExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
            for bias in (module.gate_up_proj_bias, module.down_proj_bias):
                if bias is not None:
                    init.zeros_(bias)
        if isinstance(module, MoEGate):
            init.normal_(module.weight, mean=0.0, std=std)
        if hasattr(module, "e_score_correction_bias"):
            init.zeros_(module.e_score_correction_bias)

    def moe_gates(self) -> list[nn.Module]:
        """Every MoE gate, in layer order. Each has `e_score_correction_bias` [E] (selection-only bias)."""
        return [m.gate for m in self.modules() if isinstance(m, NativeMoE) or _is_deepspeed_moe(m)]

    def _expert_groups_ready(self) -> bool:
        """Every DeepSpeed MoE block has its expert-parallel group (setup_expert_parallel or deepspeed.initialize);
        one process at ep_size 1 runs without (moe_deepspeed.groups_missing)."""
        if not self._expert_parallel_ready:
            blocks = [m for m in self.modules() if _is_deepspeed_moe(m)]
            self._expert_parallel_ready = all(b.expert_parallel_ready for b in blocks)
        return self._expert_parallel_ready

    def setup_expert_parallel(self, tp_size: int = 1) -> None:
        """Create DeepSpeed's process groups for DeepSpeed MoE blocks (after torch.distributed is up,
        or it initialises a single-process group), inside AutoTP's mesh for `tp_size` > 1. Idempotent;
        deepspeed.initialize also does it."""
        if self.config.moe_implementation == "deepspeed" and self.config.moe_layers:
            _moe_deepspeed().ensure_expert_parallel(self, tp_size)
        self._expert_parallel_ready = True

    def load_global_state_dict(self, state_dict: dict, strict: bool = True):
        """Load a full (all experts) state dict in either MoE layout; under expert parallelism, keep this rank's
        experts only."""
        state_dict = self._own_moe_layout(state_dict)
        if self.config.ep_size > 1 and self.config.moe_layers:
            ds = _moe_deepspeed()
            self.setup_expert_parallel()
            rank = ds.expert_parallel_rank(self.config.ep_size)
            state_dict = ds.localize_expert_state_dict(state_dict, self.config.num_local_experts,
                                                       self.config.ep_size, rank)
        return self.load_state_dict(state_dict, strict=strict)

    def _own_moe_layout(self, state_dict: dict) -> dict:
        if not self.config.moe_layers:
            return state_dict
        if self.config.moe_implementation == "deepspeed":
            return to_deepspeed_layout(state_dict)
        return from_deepspeed_layout(state_dict)

    def global_state_dict(self) -> dict:
        """The full state dict with global expert ids; a collective under expert parallelism."""
        if self.config.ep_size > 1 and self.config.moe_layers:
            return _moe_deepspeed().globalize_expert_state_dict(self)
        return self.state_dict()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' loader, then the MoE weights when the checkpoint's layout is not the block's (a
        native/Mixtral-layout checkpoint into DeepSpeed MoE, or an older DeepSpeed-named one into the native
        block), and this rank's experts by global id under expert parallelism."""
        loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, info) with output_loading_info=True
        if model.config.moe_layers:
            if model.config.moe_implementation == "deepspeed" and torch.distributed.is_initialized():
                model.setup_expert_parallel()  # one process without torch.distributed needs no groups (ep_size 1)
            _load_moe_weights(model, str(pretrained_model_name_or_path))
        return loaded

    def save_pretrained(self, save_directory, *args, **kwargs):
        """A portable checkpoint: every expert in the native (Mixtral) layout, and a config that loads with the
        native MoE on one device.

        Under expert parallelism the experts are gathered first: call it on every rank, with
        `is_main_process=(rank == 0)`.
        """
        config = self.config
        if config.moe_layers:
            state_dict = kwargs.get("state_dict")
            if state_dict is None:
                state_dict = self.global_state_dict() if config.ep_size > 1 else self.state_dict()
            kwargs["state_dict"] = from_deepspeed_layout(state_dict)
        running = config.moe_implementation, config.ep_size
        config.moe_implementation, config.ep_size = "native", 1
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            config.moe_implementation, config.ep_size = running


def _moe_deepspeed():
    """adaptive.models.moe_deepspeed, imported on demand: it imports DeepSpeed. By name, so that the copy of this
    file an adaptive export carries (export.write_remote_code) imports only torch, transformers and its sibling
    files; an export's config says moe_implementation "native", so that copy never asks for it."""
    return importlib.import_module("adaptive.models.moe_deepspeed")


def _is_deepspeed_moe(module: nn.Module) -> bool:
    return type(module).__name__ == "DeepSpeedMoE"


def _is_moe_key(key: str) -> bool:
    return is_deepspeed_key(key) or re.search(r"mlp\.(experts\.|gate\.(weight|e_score_correction_bias)$)", key) is not None


def _load_moe_weights(model: AdaptivePreTrainedModel, path: str) -> None:
    """Fill the model's MoE weights from the safetensors files in `path`, converting the layout and keeping
    this rank's experts under expert parallelism. A MoE weight in neither layout keeps transformers' treatment
    of a missing weight (initialised) and is named in a warning."""
    import glob
    import os

    from safetensors import safe_open

    own = model.state_dict(keep_vars=True)
    own_moe = {k for k in own if _is_moe_key(k)}
    files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else []
    if not files:
        if model.config.ep_size > 1:
            raise AdaptiveError(f"expert parallelism loads experts from a local directory; {path!r} is not one")
        return  # transformers' own loader did it (a hub id, or state_dict= without a checkpoint folder)
    prefix = model.base_model_prefix + "."

    def own_name(key: str) -> str | None:  # checkpoints of the base model lack the "model." prefix, and vice versa
        return next((c for c in (key, key.removeprefix(prefix), prefix + key) if c in own), None)

    handles = [safe_open(f, framework="pt") for f in files]
    on_disk = {key: h for h in handles for key in h.keys() if _is_moe_key(key)}
    if model.config.ep_size == 1 and all(own_name(k) in own_moe for k in on_disk) and \
            len({own_name(k) for k in on_disk}) == len(own_moe):
        return  # same layout: transformers' loader has filled every MoE weight already
    state = model._own_moe_layout({key: h.get_tensor(key) for key, h in on_disk.items()})
    if model.config.ep_size > 1:
        ds = _moe_deepspeed()
        model.setup_expert_parallel()
        state = ds.localize_expert_state_dict(state, model.config.num_local_experts, model.config.ep_size,
                                              ds.expert_parallel_rank(model.config.ep_size))
    filled = set()
    with torch.no_grad():
        for key, value in state.items():
            name = own_name(key)
            if name is not None:
                own[name].copy_(value)
                filled.add(name)
    if own_moe - filled:
        logger.warning("%s holds no weight for %s (and %d more MoE tensors) in either MoE layout: initialised",
                       path, sorted(own_moe - filled)[0], len(own_moe - filled) - 1)


class AdaptiveModel(AdaptivePreTrainedModel):
    def __init__(self, config: AdaptiveConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([AdaptiveDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = AdaptiveRMSNorm(config.hidden_size, eps=config.rms_norm_eps, lean=config.kernels == "lean")
        self.rotary_emb = AdaptiveRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> AdaptiveModelOutputWithPast:
        config = self.config
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if use_cache is None:
            # A training step never reads a KV cache: building one holds every layer's keys and values and
            # sends MoD-routed layers down the masked attention path. Only an explicit request builds one.
            use_cache = config.use_cache and not (self.training and torch.is_grad_enabled())
        output_hidden_states = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        output_attentions = config.output_attentions if output_attentions is None else output_attentions
        output_router_logits = config.output_router_logits if output_router_logits is None else output_router_logits
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            use_cache = False  # the checkpointed layers drop the cache anyway
        if config.moe_implementation == "deepspeed" and config.moe_layers and not self._expert_groups_ready():
            # one process at ep_size 1 runs without groups; several need setup's collective first, on every rank
            missing = _moe_deepspeed().groups_missing(config.ep_size)
            if missing:
                raise AdaptiveError(missing)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=config)
        if cache is not None:
            install_routed_cache_layers(cache, config.mod_layers, config.num_hidden_layers)
        seq = inputs_embeds.shape[1]
        given_position_ids = position_ids
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(seq, device=inputs_embeds.device) + past).unsqueeze(0)

        # Which new tokens are real: MoD routes only those, MoE gives padding no expert capacity.
        padding_mask = None
        prepared = isinstance(attention_mask, dict) or (attention_mask is not None and attention_mask.dim() != 2)
        if prepared and config.mod_layers:
            raise AdaptiveError("MoD-routed models take a 2D attention_mask (batch, past + new tokens)")
        if attention_mask is not None and not prepared and (config.mod_layers or config.moe_layers):
            current = attention_mask[:, -seq:].bool()
            padding_mask = None if bool(current.all()) else current  # unpadded batches keep the fast path
        if config.mod_layers and seq > 1 and (given_position_ids is not None or "cu_seq_lens_q" in kwargs):
            _refuse_packed_sequences(given_position_ids, padding_mask, kwargs)
        if isinstance(attention_mask, dict):
            # generate() with a compileable (static) cache prepares the masks per attention kind
            causal_mask = attention_mask["full_attention"]
        else:
            # Only caller-given position ids can describe packed sequences; checking ours would cost a host sync.
            causal_mask = create_causal_mask(
                config=config, inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache,
                position_ids=given_position_ids,
            )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        all_hidden = [hidden_states] if output_hidden_states else None
        attentions = [] if output_attentions else None
        layer_outputs: list[LayerOutput] = []
        for layer in self.layers:
            hidden_states, out = layer(
                hidden_states, attention_mask=causal_mask, position_ids=position_ids, cache=cache,
                use_cache=use_cache, position_embeddings=position_embeddings, padding_mask=padding_mask,
                output_attentions=output_attentions, **kwargs,
            )
            layer_outputs.append(out)
            if all_hidden is not None:
                all_hidden.append(hidden_states)
            if attentions is not None:
                attentions.append(out.attention)
        hidden_states = self.norm(hidden_states)
        if all_hidden is not None:
            all_hidden[-1] = hidden_states
        aux_loss, router_stats = _collect_router_stats(config, layer_outputs)
        router_logits = None
        if output_router_logits:
            router_logits = tuple(o.moe.router_logits for o in layer_outputs if o.moe is not None)
        return AdaptiveModelOutputWithPast(
            last_hidden_state=hidden_states,
            cache=cache if use_cache else None,
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
            attentions=tuple(attentions) if attentions is not None else None,
            aux_loss=aux_loss,
            router_stats=router_stats,
            router_logits=router_logits,
        )


def _refuse_packed_sequences(position_ids, padding_mask, kwargs) -> None:
    """Raise if a batch packs several sequences per row (position ids restart, or flash-attention
    sequence boundaries): MoD's per-row top-k would share one routing budget across them."""
    if "cu_seq_lens_q" in kwargs:
        restarts = True
    else:
        step = position_ids[:, 1:] - position_ids[:, :-1]
        inside = torch.ones_like(step, dtype=torch.bool)
        if padding_mask is not None:  # left padding's placeholder positions are not a restart
            inside = padding_mask[:, 1:] & padding_mask[:, :-1]
        restarts = bool(((step != 1) & inside).any())  # one host sync, only for caller-given position ids
    if restarts:
        raise AdaptiveError(
            "packed sequences (position_ids that restart inside a row) are not supported by MoD-routed models; "
            "pad each sequence to its own row instead"
        )


class AdaptiveForCausalLM(AdaptivePreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # Llama's: under tensor parallelism the head is column-parallel with its logits gathered, so the loss takes
    # the plain path (`_lean_loss`: the head is no longer ours)
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: AdaptiveConfig):
        super().__init__(config)
        self.model = AdaptiveModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = LeanLMHead(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> AdaptiveCausalLMOutputWithPast:
        """`labels` are the input ids (not shifted): the loss shifts them once, as in transformers. Or
        `shift_labels` (a keyword): labels already shifted, as Ulysses sequence parallelism shards them
        (DeepSpeed's `UlyssesSPDataLoaderAdapter` shifts before it cuts the sequence); with
        `num_items_in_batch` the loss is this shard's summed token loss over that count.

        In training with labels and `config.kernels == "lean"`, the loss goes through the chunked LM
        head (`lean.ChunkedLMLossFunction`) and `logits` is None (as Liger-Kernel's fused loss does):
        the full logits are never built. Evaluation, generation and `kernels="plain"` return logits.
        """
        shifted = kwargs.pop("shift_labels", None)
        outputs: AdaptiveModelOutputWithPast = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
            inputs_embeds=inputs_embeds, use_cache=use_cache, output_hidden_states=output_hidden_states,
            output_attentions=output_attentions, output_router_logits=output_router_logits, **kwargs,
        )
        loss = logits = None
        wants_loss = labels is not None or shifted is not None
        if wants_loss and self._lean_loss(logits_to_keep):
            loss = lean_causal_lm_loss(self.lm_head, outputs.last_hidden_state, labels,
                                       kwargs.get("num_items_in_batch"), shifted_labels=shifted)
        else:
            logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
            if wants_loss:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                          shift_labels=shifted, **kwargs)
        if loss is not None and outputs.aux_loss is not None:
            loss = loss + outputs.aux_loss.to(loss.device)
        return AdaptiveCausalLMOutputWithPast(
            loss=loss,
            aux_loss=outputs.aux_loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_stats=outputs.router_stats,
            router_logits=outputs.router_logits,
        )

    def _lean_loss(self, logits_to_keep) -> bool:
        """The chunked loss: lean kernels, training, all positions, and our head (a resized vocabulary gets
        transformers' plain nn.Linear)."""
        return (self.config.kernels == "lean" and self.training and isinstance(logits_to_keep, int)
                and logits_to_keep == 0 and isinstance(self.lm_head, LeanLMHead))


__all__ = [
    "AdaptiveForCausalLM",
    "AdaptiveModel",
    "AdaptivePreTrainedModel",
    "AdaptiveCausalLMOutputWithPast",
    "AdaptiveModelOutputWithPast",
    "AdaptiveRouterStats",
]
