"""Micro-batches from this rank's training blocks, and one pass over its eval blocks.

Resume contract: `SampleIterator.state_dict()` (after `commit()`) is JSON: the rank-local `position`
(samples consumed) and, when streaming, the loader's state. `SampleIterator(train, start=position,
state=that dict)` gives exactly the samples an uninterrupted iterator would have given from there on,
in the same micro-batches. Map-style data need only the position (any sample is reachable in O(1));
streaming data need the state.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from adaptive.errors import AdaptiveError
from adaptive.train.data.packing import StreamingPackedDataset, TrainData

if TYPE_CHECKING:
    import torch

class SampleIterator:
    """This rank's training samples from `start` on, in micro-batches of any size.

    `position` is the rank-local index of the next sample. The micro-batch size may change between
    calls (the OOM ladder does this) without changing which samples come next. Streaming data come
    from a `StatefulDataLoader` (worker processes; `adaptive.train.data.loader`).

    Checkpointing: `commit()` marks the samples drawn so far as consumed (the loop calls it when a
    step completes; a retried step reuses the batch it drew once), and `state_dict()` is the JSON
    state as of the last commit: pass it back as `state` (with `start` = its position) to resume.
    """

    def __init__(self, data: TrainData, start: int = 0, state: dict[str, Any] | None = None) -> None:
        if start < 0:
            raise AdaptiveError(f"start sample must be >= 0, got {start}")
        self.data, self.position = data, start
        self._loader = self._stream = None
        loader_state = None
        if isinstance(data, StreamingPackedDataset):
            from adaptive.train.data.loader import stateful_loader

            loader_state = _check_loader_state(data, start, state)
            self._loader = stateful_loader(data, loader_state)
            self._stream = iter(self._loader)
        self._drawn = self._committed = self._state(loader_state)

    def _state(self, loader_state: dict[str, Any] | None) -> dict[str, Any]:
        workers = self.data.workers if self._loader is not None else None
        return {"position": self.position, "workers": workers, "loader": loader_state}

    def next_batch(self, micro_batch_size: int) -> dict[str, torch.Tensor]:
        if micro_batch_size < 1:
            raise AdaptiveError(f"micro_batch_size must be positive, got {micro_batch_size}")
        if self._stream is not None:
            blocks = [next(self._stream) for _ in range(micro_batch_size)]
        else:
            blocks = [self.data[i] for i in range(self.position, self.position + micro_batch_size)]
        self.position += micro_batch_size
        # the loader's state right after this batch was drawn (a copy: JSON round trip, so it stays JSON)
        self._drawn = self._state(json.loads(json.dumps(self._loader.state_dict())) if self._loader is not None else None)
        return _as_batch(blocks)

    def commit(self) -> None:
        """The samples drawn so far are consumed: `state_dict()` moves past them."""
        self._committed = self._drawn

    def state_dict(self) -> dict[str, Any]:
        return self._committed


def _check_loader_state(data: StreamingPackedDataset, start: int, state: dict[str, Any] | None) -> dict[str, Any] | None:
    loader_state = (state or {}).get("loader")
    if loader_state is None:
        if start:
            raise AdaptiveError(f"resuming streamed data at sample {start} needs the loader state a checkpoint saves "
                                "(data_state_<rank>.json), and there is none; resume from a checkpoint that has it")
        return None
    if state.get("position") != start or state.get("workers") != data.workers:
        raise AdaptiveError(f"the saved data state is at sample {state.get('position')} with {state.get('workers')} "
                            f"loader worker(s), this run at sample {start} with {data.workers}: resume with "
                            f"--data-workers {state.get('workers')} (the sample order depends on it)")
    return loader_state


def _as_batch(blocks: list[np.ndarray] | list[torch.Tensor] | list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    import torch

    if isinstance(blocks[0], dict):  # instruction blocks bring their labels (and position_ids when packed)
        return {key: torch.stack([torch.as_tensor(b[key]) for b in blocks]).to(torch.int64) for key in blocks[0]}
    input_ids = torch.stack([torch.as_tensor(b) for b in blocks]).to(torch.int64)
    # Labels are the inputs: HF causal-LM models shift them by one inside. A separate tensor, so the
    # loop may mask labels in place without touching the inputs.
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def batches(train: TrainData, micro_batch_size: int, start_sample: int = 0,
            state: dict[str, Any] | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Endless training micro-batches {"input_ids", "labels"}: LongTensor [micro_batch_size, seq_len]
    (instruction data: labels -100 where not trained, and "position_ids" when packed).

    Starts at this rank's sample `start_sample`; streaming data past the start also need the
    `state` a `SampleIterator` saved there (see the resume contract in the module docstring).
    """
    samples = SampleIterator(train, start_sample, state)
    while True:
        yield samples.next_batch(micro_batch_size)


def eval_batches(evaluation: TrainData, micro_batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """One pass over this rank's eval blocks, in order; the last batch may be smaller.

    Map-style eval gives every rank the same number of blocks, so per-batch collectives line up.
    """
    if micro_batch_size < 1:
        raise AdaptiveError(f"micro_batch_size must be positive, got {micro_batch_size}")
    if isinstance(evaluation, StreamingPackedDataset):
        stream: Iterator[np.ndarray] = evaluation.blocks()
    else:
        stream = (evaluation[i] for i in range(len(evaluation)))
    pending: list[np.ndarray] | list[dict[str, np.ndarray]] = []
    for block in stream:
        pending.append(block)
        if len(pending) == micro_batch_size:
            yield _as_batch(pending)
            pending = []
    if pending:
        yield _as_batch(pending)


def samples_before_step(step: int, micro_batch_size: int, gradient_accumulation_steps: int) -> int:
    """Rank-local samples consumed by `step` optimizer steps, when micro-batch and accumulation never changed."""
    return step * micro_batch_size * gradient_accumulation_steps


__all__ = ["SampleIterator", "batches", "eval_batches", "samples_before_step"]
