"""Ulysses sequence parallelism for the loop, through DeepSpeed's Arctic Long Sequence Training pieces.

accelerate's `ParallelismConfig(sp_backend="deepspeed")` makes `accelerator.prepare` call DeepSpeed's
`UlyssesSPAttentionHF.register_with_transformers`: it builds the SP groups (`parallel_state_sp`), hands them
to `deepspeed.initialize` as its `mpu`, and puts Ulysses in place of the model's attention function
(transformers' `ALL_ATTENTION_FUNCTIONS["sdpa"]`, which `AdaptiveAttention` calls). Each rank holds 1/sp of
every sequence; the attention all-to-alls shards of the sequence into shards of the heads and back.

The data: each rank draws its own blocks, as under data parallelism. `UlyssesSPDataLoaderAdapter` gathers
the SP group's micro-batches, shifts the labels over the whole sequence (a shard's last token predicts the
next shard's first), and gives each rank its shard of each of them in turn. So a rank runs sp x the
accumulation micro-batches per step, the whole group on one sequence at a time, and a step trains on the
same sequences as data parallelism over the same processes.

The loss is exact. With N the group's unmasked labels in a micro-batch, each rank backpropagates its shard's
summed token loss / N (the model's `num_items_in_batch`): the shards' losses sum to the sequence's mean, and
DeepSpeed's reduction (a sum over all ranks divided by the data-parallel ranks, world / sp) leaves the
gradient data parallelism gives. ZeRO-3's reduce-scatter divides by the whole world instead, so there the
backpropagated loss is multiplied by sp (`gradient_scale`, adaptive/engine.py ulysses_gradient_scale). The loss
logged is the shards' sum, all-reduced over the group.

Evaluation runs whole blocks without sharding (`disable_in_eval`): every rank evaluates its own blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from adaptive.errors import AdaptiveError

ATTENTION = "sdpa"  # the attention Ulysses wraps: eager needs a 4D mask, which Ulysses drops


def parallelism_config(sp_size: int, world_size: int) -> Any:
    """accelerate's parallelism config for Ulysses with DeepSpeed (None without sequence parallelism). The
    sequence may change while training runs (the OOM ladder shortens it), so its length is variable."""
    if sp_size == 1:
        return None
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation=ATTENTION)
    # dp_replicate: the data-parallel ranks accelerate counts in DeepSpeed's train_batch_size
    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp_size, dp_replicate_size=world_size // sp_size,
                             sp_handler=handler)


@dataclass
class SequenceShards:
    """This rank's place in its SP group, and what the loop asks of it."""

    group: Any
    rank: int
    size: int
    device: torch.device
    gradient_scale: float = 1.0  # what DeepSpeed's reduction needs the loss multiplied by (engine.ulysses_gradient_scale)

    @classmethod
    def from_deepspeed(cls, device: torch.device, engine: Any) -> SequenceShards:
        from adaptive.engine import sequence_parallel_group, ulysses_gradient_scale

        group, rank, size = sequence_parallel_group()
        return cls(group, rank, size, device, ulysses_gradient_scale(engine))

    def shard(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """This rank's shard of each of the group's micro-batches, in DeepSpeed's order (every rank's first
        micro-batch, then every rank's second, ...): `input_ids`, `position_ids`, `shift_labels`."""
        from adaptive.engine import ulysses_data_adapter

        batches = []
        for batch in micro_batches:
            if "attention_mask" in batch and not bool(batch["attention_mask"].all()):
                raise AdaptiveError("sequence parallelism takes unpadded blocks: Ulysses drops the attention mask")
            rows, seq = batch["input_ids"].shape
            if seq % self.size:
                raise AdaptiveError(f"the sequence ({seq} tokens) must be divisible by sp_size ({self.size})")
            positions = torch.arange(seq, dtype=torch.long).unsqueeze(0).expand(rows, seq)
            batches.append({"input_ids": batch["input_ids"], "labels": batch["labels"], "position_ids": positions})
        # the adapter wraps any iterable of batches; the step's micro-batches are one
        return list(ulysses_data_adapter(batches, self.rank, self.group, self.size, self.device))

    def label_count(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The group's unmasked labels in this micro-batch (one small all-reduce)."""
        count = (batch["shift_labels"] != -100).sum().to(self.device, torch.float32)
        torch.distributed.all_reduce(count, group=self.group)
        return count

    def group_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The whole sequence's loss: the shards' losses (each over the group's count) summed, for the log."""
        total = loss.detach().clone()
        torch.distributed.all_reduce(total, group=self.group)
        return total


__all__ = ["ATTENTION", "SequenceShards", "parallelism_config"]
