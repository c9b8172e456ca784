"""Pipeline parallelism as DeepSpeed 0.19.8's pipeline engine runs it (deepspeed/runtime/pipe/).

- The model is a PipelineModule: embedding, the decoder blocks, the final norm and the head, one LayerSpec each,
  split into `pp` stages by DeepSpeed's default `partition_method="parameters"` (pipe/module.py:133, :409-411):
  each LayerSpec weighs its trainable parameters. A tied head is a TiedLayerSpec whose module (and its weight)
  exists on the first and the last stage, so it weighs V x h there too. We take the smallest possible heaviest
  stage, filled from the front: DeepSpeed's own solver (runtime/utils.py:627 partition_balanced) minimises
  the spread between the heaviest and the lightest stage, which has the same heaviest stage where the blocks are
  alike; front-loading is the memory-pessimistic tie-break, as the first stages hold the most micro-batches.
- The schedule is TrainSchedule (pipe/schedule.py:189), non-interleaved 1F1B: 2 (m + p - 1) forward/backward
  steps (schedule.py:200) for m micro-batches, m = gradient_accumulation_steps (pipe/engine.py:93). Stage s
  keeps min(p - s, m) micro-batches' activations (schedule.py:247-257 num_pipe_buffers). A step takes
  (m + p - 1) slots of the slowest stage's forward + backward of one micro-batch: the bubble is (p - 1)/(m + p - 1).
- Activations cross stages by blocking send/recv (pipe/p2p.py:46-64: async_op is refused), on the critical path:
  each slot sends one activation forward and one gradient back, micro-batch x sequence x hidden 16-bit values.
  With tensor parallelism inside a stage each TP rank sends 1/tp and the receivers all-gather
  (pipe/engine.py:137-138 pipe_partitioned, grad_partitioned, on by default in runtime/config.py:279-280).
- Gradients are all-reduced once per step over each stage's data-parallel group, after the last backward
  (pipe/engine.py:79 turns the overlapped backward all-reduce off; schedule.py:238-241 ReduceGrads at the end):
  exposed, nothing hides it. ZeRO-2 and ZeRO-3 are refused (pipe/engine.py:76-77).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from adaptive.plan.architecture.blocks import block_type
from adaptive.plan.architecture.params import count_params
from adaptive.plan.architecture.presets import ModelSpec


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its decoder blocks [first_block, stop_block), and whether it holds the embedding (first
    stage) or the final norm and head (last stage)."""

    index: int
    first_block: int
    stop_block: int
    embedding: bool
    head: bool
    params: int  # parameters it holds (a tied head's weight counted on both ends, as DeepSpeed builds it)
    expert_params: int

    @property
    def blocks(self) -> int:
        return self.stop_block - self.first_block


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """Idle share of a 1F1B step: (p - 1)/(m + p - 1)."""
    return (pp - 1) / (micro_batches + pp - 1)


def in_flight(stage: int, pp: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage `stage` holds at once (schedule.py:247-257, without its floor of 2
    buffers, which are allocated but hold no activations beyond the micro-batches in flight)."""
    return min(pp - stage, micro_batches)


def layer_weights(spec: ModelSpec) -> tuple[int, ...]:
    """Trainable parameters of each LayerSpec in order: embedding, the blocks, the final norm, the head."""
    c = count_params(spec)
    embed = spec.vocab_size * spec.hidden_size
    return (embed, *c.per_layer, spec.hidden_size, embed)


def _fill(weights: tuple[int, ...], parts: int, bound: int) -> list[int] | None:
    """Stage boundaries filling each stage from the front up to `bound`; None when `parts` stages cannot hold all."""
    cuts, total = [0], 0
    for i, w in enumerate(weights):
        if w > bound:
            return None
        if total + w > bound:
            cuts.append(i)
            total = 0
        total += w
    cuts.append(len(weights))
    if len(cuts) - 1 > parts:
        return None
    while len(cuts) - 1 < parts:  # fewer stages were needed: split the last stage of two LayerSpecs or more
        j = max((j for j in range(len(cuts) - 1) if cuts[j + 1] - cuts[j] >= 2), default=None)
        if j is None:
            return None
        cuts.insert(j + 1, cuts[j + 1] - 1)
    return cuts


@lru_cache(maxsize=256)
def partition(spec: ModelSpec, pp: int) -> tuple[Stage, ...]:
    """The stages of `spec` over `pp` (see the module's docstring)."""
    weights = layer_weights(spec)
    if pp > len(weights) - 2:
        raise ValueError(f"{pp} stages for {spec.num_hidden_layers} blocks")
    low, high = max(weights), sum(weights)
    while low < high:  # the smallest heaviest stage
        mid = (low + high) // 2
        if _fill(weights, pp, mid) is None:
            low = mid + 1
        else:
            high = mid
    cuts = _fill(weights, pp, low)
    assert cuts is not None
    expert = count_params(spec).expert // max(1, spec.num_moe_layers)
    moe_layers = {i for i, t in enumerate(spec.layer_types) if block_type(t).has_experts}
    stages = []
    for i in range(pp):
        lo, hi = cuts[i], cuts[i + 1]  # LayerSpec indices; block j is LayerSpec j + 1
        first, stop = max(0, lo - 1), min(spec.num_hidden_layers, hi - 1)
        stages.append(Stage(index=i, first_block=first, stop_block=max(first, stop), embedding=lo == 0,
                            head=hi == len(weights), params=sum(weights[lo:hi]),
                            expert_params=expert * len(moe_layers & set(range(first, stop)))))
    return tuple(stages)


def p2p_bytes_per_micro_batch(spec: ModelSpec, seq_len: int, micro_batch: int, bytes_per_value: int) -> int:
    """One boundary's activation (or its gradient): micro-batch x sequence x hidden values."""
    return micro_batch * seq_len * spec.hidden_size * bytes_per_value


__all__ = ["Stage", "bubble_fraction", "in_flight", "layer_weights", "p2p_bytes_per_micro_batch", "partition"]
