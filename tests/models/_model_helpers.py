"""Tiny fp32 configs shared by the model tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

ARCHS = ("dense", "moe", "mod", "hybrid")

TINY = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, moe_intermediate_size=32, max_position_embeddings=256,
)


def tiny_config(arch: str = "dense", **overrides):
    """The debug preset (5 layers) shrunk to hidden 32, vocab 128; MoE layers have 8 experts, top-2."""
    from adaptive.models import AdaptiveConfig

    return AdaptiveConfig.from_preset("debug", arch=arch, **{**TINY, **overrides})


def tiny_model(arch: str = "dense", seed: int = 0, **overrides):
    import torch

    from adaptive.models import AdaptiveForCausalLM

    torch.manual_seed(seed)
    return AdaptiveForCausalLM(tiny_config(arch, **overrides))


PAD = 0


def prompts():
    """Two prompts of 9 tokens (vocab 128), the second left-padded by 3: (input_ids, attention_mask)."""
    import torch

    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = PAD, 0
    return ids, mask
