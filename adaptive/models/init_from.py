"""Start our model from a checkpoint's state dict: a transformers Llama, Mistral, Qwen2 or Mixtral, or an adaptive
export. Pure mapping: state dicts in, state dicts out; reading the folder is `adaptive.train.run_folder.init_from`'s job.

Names are `export.py`'s mapping read backwards. Our dense blocks carry Llama's names (export writes them as they
are), and our native MoE layout is Mixtral's in memory (export writes `mixtral_state_dict`, i.e.
`from_deepspeed_layout` of ours). transformers saves Mixtral's experts one by one (`block_sparse_moe.experts.{e}.
w1|w3|w2`): renamed to DeepSpeed's per-expert names, `from_deepspeed_layout` stacks them like our own.

Sparse upcycling (Komatsuzaki et al. 2022, arXiv 2212.05055): a dense FFN under a target MoE layer becomes every
expert of it; the router keeps our model's init. With top-2 the two combine weights are renormalised to sum to 1
(`moe.route`) and the experts are equal, so at step 0 the layer computes the dense FFN (up to rounding) wherever
nothing is dropped: always in eval, within the capacity in training. Top-1 weights the copy by its gate
probability instead. MoD routers start fresh as well; the blocks they route are the dense ones, copied.
"""

from __future__ import annotations

import copy
import logging
import re
from typing import NamedTuple

import torch

from adaptive.errors import AdaptiveError
from adaptive.models.configuration_adaptive import AdaptiveConfig
from adaptive.models.modeling_adaptive import AdaptiveForCausalLM
from adaptive.models.moe import from_deepspeed_layout
from adaptive.plan.architecture.presets import ModelSpec

logger = logging.getLogger(__name__)

# how transformers saves Mixtral's experts (and the hub holds them): w1 gate, w3 up, w2 down
_MIXTRAL_EXPERT = re.compile(r"^(.*\.)block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight|bias)$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_DENSE_MLP = ("gate_proj", "up_proj", "down_proj")
# fields that `from_spec` does not set and a checkpoint's config.json decides
_NUMERICS = ("rms_norm_eps", "hidden_act", "rope_parameters", "initializer_range", "attention_dropout")
_NOT_CARRIED = {"moe_implementation", "ep_size", "bos_token_id", "eos_token_id", "pad_token_id", "preset", "arch"}
# fields `from_spec` sets from the plan's spec (an adaptive export's own values for them are in the spec already)
_SHAPE = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "block_types", "max_position_embeddings", "tie_word_embeddings", "qkv_bias",
          "o_bias", "mlp_bias", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "mod_capacity",
          "mod_predictor_hidden_size"}


class InitState(NamedTuple):
    """A checkpoint mapped onto our native (Mixtral-layout) names."""

    state_dict: dict[str, torch.Tensor]
    fresh: frozenset[str]  # our keys that keep the model's init: routers the checkpoint has no place for
    upcycled: tuple[int, ...]  # layers whose experts are copies of the dense FFN


def adaptive_config(hf_config: dict, spec: ModelSpec, **overrides) -> AdaptiveConfig:
    """Our config for `spec` (the plan's shape and layer pattern, read from `hf_config`), with the numerics a
    checkpoint carries beyond its shape (norm eps, activation, RoPE); an adaptive export keeps its routing settings."""
    model_type = hf_config.get("model_type")
    fields = set(AdaptiveConfig.__annotations__)  # its own fields, not PreTrainedConfig's (architectures, dtype, ...)
    carried = {k: hf_config[k] for k in _NUMERICS if hf_config.get(k) is not None}
    if model_type == "mixtral":
        carried["router_aux_loss_coef"] = hf_config.get("router_aux_loss_coef", 0.01)
    if model_type == "adaptive":
        carried.update({k: v for k, v in hf_config.items() if k in fields and k not in _SHAPE | _NOT_CARRIED})
    window = hf_config.get("sliding_window") if model_type != "qwen2" or hf_config.get("use_sliding_window") else None
    if window:
        logger.warning("%s's sliding-window attention (%d tokens) has no equivalent here: attention is full, which "
                       "is the same for sequences up to %d tokens", model_type, window, window)
    return AdaptiveConfig.from_spec(spec, **{**carried, **overrides})


def require_finite(state_dict: dict[str, torch.Tensor], where: str) -> None:
    for key, value in state_dict.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise AdaptiveError(f"{where}: {key} holds non-finite values (NaN or inf); start from a healthy checkpoint")


def to_native(state_dict: dict[str, torch.Tensor], config: AdaptiveConfig) -> InitState:
    """A checkpoint's state dict (Llama/Mistral/Qwen2/Mixtral/adaptive names, either MoE layout) on our native
    names, dense FFNs upcycled into the target's MoE layers."""
    renamed = {}
    for key, value in state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):  # older checkpoints saved this buffer; it is rebuilt
            continue
        match = _MIXTRAL_EXPERT.match(key)
        if match:
            prefix, expert, w, kind = match.groups()
            key = f"{prefix}mlp.deepspeed_moe.experts.deepspeed_experts.{expert}.{_MIXTRAL_PROJ[w]}.{kind}"
        renamed[key.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = value
    native = from_deepspeed_layout(renamed)
    if config.tie_word_embeddings:
        native.pop("lm_head.weight", None)  # tied: the embedding is the head
    fresh, upcycled = set(), []
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."
        if i in config.moe_layers:
            fresh.add(f"{layer}mlp.gate.e_score_correction_bias")  # Mixtral has no selection bias: zeros are none
            if f"{layer}mlp.gate_proj.weight" in native:
                _upcycle(native, f"{layer}mlp.", config.num_local_experts)
                fresh.add(f"{layer}mlp.gate.weight")
                upcycled.append(i)
        if i in config.mod_layers and f"{layer}mod.router.weight" not in native:
            fresh.add(f"{layer}mod.router.weight")
            fresh.update(f"{layer}mod.predictor.{j}.weight" for j in (0, 2))
    return InitState(native, frozenset(fresh), tuple(upcycled))


def _upcycle(state: dict[str, torch.Tensor], prefix: str, num_experts: int) -> None:
    """The dense FFN at `prefix` as `num_experts` equal experts in our grouped layout (gate rows, then up)."""
    for kind, suffix in (("weight", ""), ("bias", "_bias")):
        parts = [state.pop(f"{prefix}{proj}.{kind}", None) for proj in _DENSE_MLP]
        if parts[0] is None:
            continue
        gate, up, down = parts
        state[f"{prefix}experts.gate_up_proj{suffix}"] = torch.stack([torch.cat([gate, up])] * num_experts)
        state[f"{prefix}experts.down_proj{suffix}"] = torch.stack([down] * num_experts)


def check_against(native: InitState, config: AdaptiveConfig, where: str) -> None:
    """Every weight of our model (native layout, all experts) is in `native` with its shape, or is fresh; nothing
    else is. One line naming the first difference."""
    native_config = copy.deepcopy(config)  # the checkpoint layout: every expert, native names
    native_config.moe_implementation, native_config.ep_size = "native", 1
    with torch.device("meta"):
        reference = AdaptiveForCausalLM(native_config)
    expected = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    for key, value in native.state_dict.items():
        if key not in expected:
            raise AdaptiveError(f"{where}: the checkpoint holds {key}, which the model built from its config.json has "
                                "no place for")
        if tuple(value.shape) != expected[key]:
            raise AdaptiveError(f"{where}: {key} is {list(value.shape)} in the weights but {list(expected[key])} by "
                                "its config.json (shape mismatch)")
    missing = sorted(set(expected) - set(native.state_dict) - native.fresh)
    if missing:
        raise AdaptiveError(f"{where}: the checkpoint lacks {missing[0]}" +
                            (f" and {len(missing) - 1} more weights" if len(missing) > 1 else ""))


__all__ = ["InitState", "adaptive_config", "check_against", "require_finite", "to_native"]
