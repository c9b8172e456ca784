"""HF-compatible model classes: dense, MoE (native or DeepSpeed), MoD and hybrid decoders.

`import adaptive` registers these with transformers' Auto classes (see `adaptive._hf_registration`),
so `AutoModelForCausalLM.from_pretrained(path)` loads a saved adaptive model.
"""

from __future__ import annotations

_registered = False


def register_auto_classes() -> None:
    """Register AdaptiveConfig / AdaptiveModel / AdaptiveForCausalLM with the Auto classes. Idempotent.

    Defined before the submodules are imported: importing them imports transformers, whose import hook
    calls this function while this package is half-initialised. Then it returns quietly and the last
    line of this file registers.
    """
    global _registered
    if _registered:
        return
    try:
        from adaptive.models.configuration_adaptive import AdaptiveConfig
        from adaptive.models.modeling_adaptive import AdaptiveForCausalLM, AdaptiveModel
    except ImportError:
        if _importing:
            return
        raise
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    AutoConfig.register(AdaptiveConfig.model_type, AdaptiveConfig, exist_ok=True)
    AutoModel.register(AdaptiveConfig, AdaptiveModel, exist_ok=True)
    AutoModelForCausalLM.register(AdaptiveConfig, AdaptiveForCausalLM, exist_ok=True)
    _registered = True


_importing = True
from adaptive.models.configuration_adaptive import AdaptiveConfig  # noqa: E402
from adaptive.models.modeling_adaptive import (  # noqa: E402
    AdaptiveCausalLMOutputWithPast,
    AdaptiveForCausalLM,
    AdaptiveModel,
    AdaptiveModelOutputWithPast,
    AdaptivePreTrainedModel,
    AdaptiveRouterStats,
)

_importing = False
register_auto_classes()

__all__ = [
    "AdaptiveConfig",
    "AdaptiveModel",
    "AdaptiveForCausalLM",
    "AdaptivePreTrainedModel",
    "AdaptiveCausalLMOutputWithPast",
    "AdaptiveModelOutputWithPast",
    "AdaptiveRouterStats",
    "register_auto_classes",
]
