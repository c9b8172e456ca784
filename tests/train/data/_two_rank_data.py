"""Run by test_data.py under torchrun with two processes: each rank builds its own shard and the
ranks exchange what they got over gloo. Prints one JSON line from rank 0."""

import json
import sys

import torch
import torch.distributed as dist

from adaptive.train.data.batches import batches, eval_batches
from adaptive.train.data.packing import build_datasets
from adaptive.train.data.sources import DataConfig
from adaptive.train.data.tokenizer import load_tokenizer

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
cache = sys.argv[1]
# Rank 0 builds the tokenizer and the datasets cache first, as the training loop will.
if rank != 0:
    dist.barrier()
tokenizer = load_tokenizer(None)
train, evaluation = build_datasets(DataConfig(None, seq_len=64, cache_dir=cache), tokenizer, rank, world)
if rank == 0:
    dist.barrier()
per_rank = len(train)
first_epoch = torch.tensor([train.block_index(i) for i in range(per_rank)])
eval_count = torch.tensor([sum(len(b["input_ids"]) for b in eval_batches(evaluation, 8))])
first_batch = next(batches(train, 4))["input_ids"]
gathered = [torch.zeros_like(first_epoch) for _ in range(world)]
dist.all_gather(gathered, first_epoch)
counts = [torch.zeros_like(eval_count) for _ in range(world)]
dist.all_gather(counts, eval_count)
batches_seen = [torch.zeros_like(first_batch) for _ in range(world)]
dist.all_gather(batches_seen, first_batch)
if rank == 0:
    print(json.dumps({
        "num_blocks": train.num_blocks,
        "indices": [g.tolist() for g in gathered],
        "eval_counts": [int(c) for c in counts],
        "first_batches_equal": bool(batches_seen[0].equal(batches_seen[1])),
    }))
dist.destroy_process_group()
