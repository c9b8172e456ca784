"""Activation checkpointing policies on our model, as torchtitan offers them.

    off       nothing recomputed
    full      every decoder block keeps only its input and runs again in backward
    every:N   blocks 0, N, 2N, ... do so; the others keep their activations (transformers' every_n_layers)
    mlp       every block keeps its attention half's activations and recomputes its MLP half (post-attention
              norm + SwiGLU or MoE) from that half's input: per token, the attention half's bytes plus 2h

The planner's byte counts of each policy are in adaptive/plan/estimate/activations.py (`parse_checkpoint_policy`).
transformers' own classes (a fine-tune, under PEFT's wrapper or not) checkpoint whole layers: off, full and every:N;
"mlp" is our decoder layer's alone (the planner offers it only for our classes, planner.py `selective_policies`).
"""

from __future__ import annotations

from torch import nn

from adaptive.errors import AdaptiveError
from adaptive.plan.estimate.activations import parse_checkpoint_policy


def _unwrapped(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(the model whose checkpointing switches, the module holding its decoder layers): PEFT's wrapper of a
    fine-tune is looked through to transformers' class it wraps."""
    get_base = getattr(model, "get_base_model", None)  # PeftModel (LoRA, QLoRA)
    if callable(get_base) and hasattr(model, "peft_config"):
        model = get_base()
    return model, getattr(model, "model", model)


def apply_checkpointing(model: nn.Module, policy: str) -> None:
    """Set `policy` on an AdaptiveForCausalLM (or AdaptiveModel), or on transformers' class of a fine-tune (PEFT's
    wrapper looked through), replacing whatever was set before."""
    try:
        kind, n = parse_checkpoint_policy(policy)
    except ValueError as e:
        raise AdaptiveError(str(e)) from None
    pipelined = getattr(model, "set_checkpoint_policy", None)  # the pipeline module's stage (pipeline.py)
    if pipelined is not None:
        pipelined(policy)
        return
    model, base = _unwrapped(model)
    ours = all(hasattr(layer, "checkpoint_mlp") for layer in base.layers)
    if kind == "mlp" and not ours:
        raise AdaptiveError(f"checkpointing policy 'mlp' needs adaptive's model class; {type(model).__name__} "
                            "checkpoints whole layers (full or every:N)")
    if base.gradient_checkpointing:
        model.activation_checkpointing_disable()
    if ours:
        for layer in base.layers:
            layer.checkpoint_mlp = kind == "mlp"
    if kind in ("full", "every"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              every_n_layers=n)


def checkpointing_policy(model: nn.Module) -> str:
    """The policy in force, in `apply_checkpointing`'s words."""
    base = _unwrapped(model)[1]
    if any(getattr(layer, "checkpoint_mlp", False) for layer in base.layers):
        return "mlp"
    flags = [bool(layer.gradient_checkpointing) for layer in base.layers]
    if not any(flags):
        return "off"
    if all(flags):
        return "full"
    return f"every:{flags.index(True, 1) if True in flags[1:] else len(flags)}"


__all__ = ["apply_checkpointing", "checkpointing_policy"]
