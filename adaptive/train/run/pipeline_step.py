"""One optimizer step and one evaluation on DeepSpeed's pipeline engine (`--pp-size`).

`engine.train_batch` runs the whole step: the 1F1B schedule over the step's micro-batches (the gradient
accumulation steps), the data-parallel gradient reduction and the update (deepspeed/runtime/pipe/schedule.py
TrainSchedule). The first stage reads the input ids, the last the labels; every rank of a pipeline draws the
same samples (setup.load_data), so the loop's data position and resume work as in any run.

The callbacks' `on_backward_end` runs once per micro-batch after the schedule, with what the stages recorded:
the micro-batch's loss (broadcast from the last stage) and the router statistics in the HF model's shape, this
stage's layers filled (`take_router_stats`), so the metrics' and the orchestrator's all-reduces see every layer
as in a pp 1 run. What a pp 1 step does that this one cannot: a callback acting between a micro-batch's
backward and the next (they have all run), and discarding a step before its update (the schedule applies it).
The loss logged is the same quantity: the mean over the step's micro-batches of LM + router losses, averaged
over data-parallel replicas, with its LM and router parts (`get_additional_losses`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from adaptive.train.reporting.metrics import StepStats


def micro_batch_pairs(micro_batches: list[dict[str, torch.Tensor]], device: torch.device) -> list[tuple]:
    """(inputs, labels) per micro-batch, as DeepSpeed's pipeline engine loads them (pipe/engine.py
    _exec_load_micro_batch: batch[0] to the first stage, batch[1] to the last)."""
    return [(b["input_ids"].to(device), b["labels"].to(device)) for b in micro_batches]


def train_batch(engine: Any, micro_batches: list[dict[str, torch.Tensor]],
                device: torch.device) -> tuple[StepStats, list[SimpleNamespace]]:
    """Run one step through the pipeline: the step's summed losses and router statistics as the loop's StepStats
    (on every rank), and per micro-batch what a pp 1 step hands `on_backward_end` (`router_stats`, `loss`)."""
    from adaptive.models.pipeline import take_micro_losses, take_router_stats

    loss = engine.train_batch(iter(micro_batch_pairs(micro_batches, device)))
    count = len(micro_batches)
    stats = StepStats.zeros(device)
    stats.micro_batches = count
    stats.loss += loss.detach().to(device=device, dtype=torch.float64) * count
    parts = engine.agg_additional_losses  # None for a dense model
    if parts is None:
        stats.lm_loss += stats.loss
    else:
        stats.lm_loss += parts["lm_loss"].to(device=device, dtype=torch.float64) * count
        stats.aux_loss += parts["aux_loss"].to(device=device, dtype=torch.float64) * count
        stats.routed = True
    pipe = engine.module
    losses = take_micro_losses(pipe, count).to(device)
    outputs = []
    for router_stats, micro_loss in zip(take_router_stats(pipe, count), losses):
        stats.add_router_stats(router_stats)
        outputs.append(SimpleNamespace(router_stats=router_stats, loss=micro_loss, logits=None))
    return stats, outputs


def eval_loss(engine: Any, batches: list[dict[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """The mean LM loss over `batches` (equal shapes: the pipeline's buffers are sized once), on every rank."""
    out = engine.eval_batch(iter(micro_batch_pairs(batches, device)), num_micro_batches=len(batches),
                            reduce_output="avg", bcast_loss=True)
    engine.train()
    return out.to(device=device, dtype=torch.float64).reshape(())


__all__ = ["eval_loss", "micro_batch_pairs", "train_batch"]
