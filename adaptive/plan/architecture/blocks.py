"""Block types: what each kind of decoder block is made of. Code asks the type, never the name.

A new block type is one row in `BLOCK_TYPES` (plus, when it computes something new, its module in
adaptive/models). An architecture names the block type of its special layers (`moe`: every layer has
experts; `mod`: every other block is routed; `hybrid`: both), so `block_type(arch)` answers for it too.
"""

from __future__ import annotations

from adaptive.errors import AdaptiveError, closest
from adaptive.record import record


@record
class BlockType:
    """One decoder block type and what it has."""

    name: str
    has_experts: bool  # its MLP is a mixture of experts (DeepSpeed MoE or the native block)
    routed: bool  # a Mixture-of-Depths router picks the tokens the block processes
    description: str


BLOCK_TYPES: dict[str, BlockType] = {b.name: b for b in (
    BlockType(name="dense", has_experts=False, routed=False, description="attention + SwiGLU MLP"),
    BlockType(name="moe", has_experts=True, routed=False, description="attention + mixture of SwiGLU experts"),
    BlockType(name="mod", has_experts=False, routed=True, description="MoD-routed attention + SwiGLU MLP"),
    BlockType(name="hybrid", has_experts=True, routed=True, description="MoD-routed block with an MoE MLP"),
)}


def block_type(name: str) -> BlockType:
    if name not in BLOCK_TYPES:
        near = closest(name, list(BLOCK_TYPES))
        raise AdaptiveError(f"unknown block type {name!r}" + (f"; did you mean {near}?" if near else ""))
    return BLOCK_TYPES[name]


__all__ = ["BLOCK_TYPES", "BlockType", "block_type"]
