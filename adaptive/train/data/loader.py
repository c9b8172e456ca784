"""The streaming path's loader: one rank's training blocks read, tokenized and packed in worker
processes by torchdata's `StatefulDataLoader`, with a state that resumes in O(1).

`BlockStream` is the torch `IterableDataset` the loader runs: in each worker it iterates the rank's
`datasets` stream (which deals the rank's shards to the workers by itself) through
`StreamingPackedDataset.stream`, and its `state_dict()` is the state after the last block it yielded.
The loader sends that state along with every block (`snapshot_every_n_steps=1`), so
`StatefulDataLoader.state_dict()` in the training process describes exactly the blocks handed over so
far, however far the workers have read ahead. Every state is plain JSON (ints, strings, lists): it goes
into checkpoints as a JSON file, never a pickle. The loader hands over one block at a time (batch_size
None), so the loop may draw any number per step (`adaptive.train.data.batches.SampleIterator`).
"""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from adaptive.train.data.packing import StreamingPackedDataset

_PREFETCH_BLOCKS = 8  # per worker: enough to hide a tokenizer batch behind a step


class BlockStream(IterableDataset):
    """One rank's training blocks (int64 tensors [seq_len]) with a resumable, JSON state."""

    def __init__(self, data: StreamingPackedDataset) -> None:
        self.data = data
        self._state: dict[str, Any] | None = None  # None: from the start

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self._state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state = state_dict["stream"]

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        for block, state in self.data.stream(self._state, worker=info.id if info is not None else 0):
            self._state = state  # before the yield: the worker reads it right after taking this block
            yield torch.from_numpy(block)


def stateful_loader(data: StreamingPackedDataset, state: dict[str, Any] | None = None) -> StatefulDataLoader:
    """A loader over `data`'s training blocks, at `state` (a `state_dict()` of such a loader; None: the start)."""
    workers = data.workers
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in torch 2.13: not ours to fix
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        loader = StatefulDataLoader(
            BlockStream(data), batch_size=None, num_workers=workers, pin_memory=data.pin_memory,
            prefetch_factor=_PREFETCH_BLOCKS if workers else None, persistent_workers=False, snapshot_every_n_steps=1,
        )
    if state is not None:
        loader.load_state_dict(state)
    return loader


__all__ = ["BlockStream", "stateful_loader"]
