"""How a run's processes split the work besides data parallelism: Ulysses sequence parallelism (`sp`) and
AutoTP tensor parallelism (`tp`), and which combinations the runtime refuses, each in one line.

What DeepSpeed 0.19.8 combines, as this runtime uses it:
- SP with ZeRO 0-3 (DeepSpeed reduces gradients over the sequence-data-parallel group, all ranks, and
  divides by data-parallel ranks); TP with ZeRO 0-3 (ZeRO partitions over the data-parallel ranks of the
  TP mesh).
- Not SP with TP here: DeepSpeed builds its SP groups (`parallel_state_sp`) and its TP mesh
  (`groups._init_tp_mesh_device`) independently, both over consecutive ranks, so on one world they would
  overlap rather than nest.
- Not SP with MoE or MoD: a shard's router sees part of each sequence. MoD picks its top-k tokens over the
  whole sequence, and an MoE gate's capacity and balancing loss are per-shard sums, so neither would equal
  the unsharded model.
- Not TP with MoE: DeepSpeed combines the two through AutoEP (`engine._configure_expert_parallel`, which
  folds expert groups into the TP mesh), and AutoEP replaces transformers-style MoE blocks; our models run
  DeepSpeed's native `MoE` layer, whose expert groups know nothing of the TP mesh, and AutoTP's plan (the
  config's `base_model_tp_plan`) leaves its experts whole. Refused (shard the experts with `--ep-size`).
"""

from __future__ import annotations

from adaptive.errors import AdaptiveError
from adaptive.plan.blocks import block_type


def data_parallel_ranks(world_size: int, sp_size: int, tp_size: int) -> int:
    """The data-parallel ranks DeepSpeed counts: processes / (sp x tp)."""
    return world_size // (sp_size * tp_size)


def check_layout(sp_size: int, tp_size: int, world_size: int, arch: str, heads: int, kv_heads: int) -> None:
    """Refuse, in one line naming the limit, a layout this runtime cannot train exactly."""
    for name, size in (("sp_size", sp_size), ("tp_size", tp_size)):
        if size < 1:
            raise AdaptiveError(f"{name} must be at least 1, got {size}")
    if sp_size > 1 and tp_size > 1:
        raise AdaptiveError(f"sp_size ({sp_size}) with tp_size ({tp_size}): DeepSpeed's Ulysses and AutoTP groups do "
                            "not nest on one world; use one of them")
    if world_size % (sp_size * tp_size):
        size, name = (sp_size, "sp_size") if sp_size > 1 else (tp_size, "tp_size")
        raise AdaptiveError(f"the {world_size} processes must be divisible by {name} ({size})")
    kind = block_type(arch)
    if sp_size > 1:
        if kind.routed or kind.has_experts:
            what = "MoD routes the top-k tokens of the whole sequence" if kind.routed else \
                "an MoE gate's capacity and balancing loss are per-shard"
            raise AdaptiveError(f"sp_size ({sp_size}) with {arch}: {what}, so a sequence shard would not train the "
                                "same model; use sp_size 1 (sequence parallelism is for dense models)")
        if heads % sp_size:
            raise AdaptiveError(f"num_attention_heads ({heads}) must be divisible by sp_size ({sp_size}): Ulysses "
                                "gives each rank whole heads")
        if kv_heads % sp_size and sp_size % kv_heads:
            raise AdaptiveError(f"num_key_value_heads ({kv_heads}) and sp_size ({sp_size}): one must divide the other")
    if tp_size > 1:
        if kind.has_experts:
            raise AdaptiveError(f"tp_size ({tp_size}) with {arch}: DeepSpeed's MoE experts do not shard with AutoTP; "
                                "use tp_size 1 and --ep-size for the experts")
        if heads % tp_size or kv_heads % tp_size:
            raise AdaptiveError(f"num_attention_heads ({heads}) and num_key_value_heads ({kv_heads}) must be "
                                f"divisible by tp_size ({tp_size}): AutoTP gives each rank whole heads")


__all__ = ["check_layout", "data_parallel_ranks"]
