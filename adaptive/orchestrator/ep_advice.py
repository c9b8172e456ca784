"""Expert-parallel advice: measure the all-to-all share of a step, recommend an ep_size for the next
launch. The live run keeps its ep_size (changing it means re-sharding experts and optimizer state).

Measurement: on one optimizer step in every `sample_every`, the policy turns on DeepSpeed MoE's
own timers (`MOELayer.wall_clock_breakdown`, read in adaptive/engine.py: the all-to-all and
`time_moe` per forward; on a GPU they synchronise, which is why only sampled steps pay for it),
sums them over layers and micro-batches, and divides by the step's wall time. The backward pass runs
the same two all-to-alls per layer (autograd's `_AllToAll` backward), so the all-to-all time per step is
taken as 2 x the forward's: stated, not measured. Timings are the main process's own. The native MoE
holds every expert on every GPU and has no all-to-all.

Recommendation, at the end of training, from the all-to-all share
`s`, the expert load (MaxVio from the monitor) and the planner's memory model at other ep_sizes
(valid ep_sizes divide both the expert count and the world size):

    s > high_share and ep > 1                 -> the next smaller ep_size whose planned peak fits
    s < low_share and the plan's memory tight -> the next larger ep_size (experts split wider)
    otherwise                                 -> keep ep_size
    MaxVio > vio_high with ep > 1             -> noted: the rank with the hot experts sets the pace

Each recommendation is a decision in events.jsonl with the `adaptive fit ... --ep-size N` command
that re-plans it.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from adaptive.engine import moe_layers_with_timers, moe_timer_seconds, start_moe_timers, stop_moe_timers
from adaptive.orchestrator.contract import Control, TrainerState
from adaptive.orchestrator.registry import Policy, require
from adaptive.orchestrator.events import EventLog
from adaptive.orchestrator.monitor import Monitor

SAMPLES = 20  # the recommendation uses the median share of the recent timed steps


@dataclass(frozen=True)
class EPAdviceConfig:
    sample_every: int = 50  # time one optimizer step in every N
    high_share: float = 0.30
    low_share: float = 0.05
    tight_fraction: float = 0.9
    vio_high: float = 1.0

    def __post_init__(self) -> None:
        require(self.sample_every >= 1, f"sample_every must be >= 1, got {self.sample_every}")
        require(0 <= self.low_share <= self.high_share <= 1, "need 0 <= low_share <= high_share <= 1, got "
                f"{self.low_share} and {self.high_share}")
        require(0 < self.tight_fraction <= 1, f"tight_fraction must be in (0, 1], got {self.tight_fraction}")
        require(self.vio_high > 0, f"vio_high must be positive, got {self.vio_high}")


@dataclass(frozen=True)
class Recommendation:
    ep_size: int
    reason: str
    command: str | None = None


def valid_ep_sizes(num_experts: int, world_size: int) -> list[int]:
    return [d for d in range(1, num_experts + 1) if num_experts % d == 0 and world_size % d == 0]


def _fits(plan: Any, ep: int, fraction: float = 1.0) -> bool:
    from adaptive.plan.estimate.memory import estimate_memory

    setup = dataclasses.replace(plan.shown.setup, ep_size=ep)
    return estimate_memory(setup).peak_gpu_bytes <= fraction * plan.request.gpu.memory_bytes


def replan_command(plan: Any, ep: int) -> str | None:
    if plan is None:
        return None
    req = plan.request
    return (f"adaptive fit --model {req.spec.name} --arch {req.spec.arch} --gpu {req.gpu.name} "
            f"--gpus {req.gpus_per_node} --nodes {req.num_nodes} --ep-size {ep}")


def recommend_ep_size(current: int, num_experts: int, world_size: int, a2a_share: float | None,
                      max_vio: float | None, plan: Any, config: EPAdviceConfig) -> Recommendation:
    """Pure: the ep_size for the next launch, and why."""
    sizes = valid_ep_sizes(num_experts, world_size)
    note = ""
    if max_vio is not None and max_vio > config.vio_high and current > 1:
        note = f"; expert load is uneven (MaxVio {max_vio:.2f}): the rank with the hot experts sets the pace"
    if a2a_share is None:
        return Recommendation(current, "no all-to-all measured (native MoE, or no sampled step)" + note)
    share = f"all-to-all {100 * a2a_share:.1f}% of the step"
    if a2a_share > config.high_share and current > 1:
        for ep in sorted((s for s in sizes if s < current), reverse=True):
            if plan is None or _fits(plan, ep):
                return Recommendation(ep, f"{share} > {100 * config.high_share:.0f}%: fewer experts per "
                                      f"all-to-all group{note}", replan_command(plan, ep))
        return Recommendation(current, f"{share}, but no smaller ep_size fits memory{note}")
    if a2a_share < config.low_share and plan is not None and not _fits(plan, current, config.tight_fraction):
        for ep in sorted(s for s in sizes if s > current):
            return Recommendation(ep, f"{share} < {100 * config.low_share:.0f}% and memory is tight: split "
                                  f"the experts wider{note}", replan_command(plan, ep))
    return Recommendation(current, f"{share}: keep ep_size {current}{note}")


class EPAdvicePolicy:
    name = "ep"

    def __init__(self, monitor: Monitor, events: EventLog, config: EPAdviceConfig | None = None) -> None:
        self.config = config or EPAdviceConfig()
        self.monitor = monitor
        self.events = events
        self.layers: list[Any] = []
        self.samples: deque[dict[str, float]] = deque(maxlen=SAMPLES)  # the recent timed steps
        self.recommendation: Recommendation | None = None
        self._sampling = False
        self._started = 0.0
        self._num_experts = 0

    def on_train_start(self, state: TrainerState, control: Control) -> None:
        self.layers = moe_layers_with_timers(state.model)
        from adaptive.orchestrator.balance import moe_gates

        gates = moe_gates(state.model)
        self._num_experts = int(gates[0].e_score_correction_bias.numel()) if gates else 0

    def on_step_start(self, state: TrainerState, control: Control) -> None:
        every = self.config.sample_every
        if not self.layers or every <= 0 or (state.step + 1) % every:
            return
        start_moe_timers(self.layers)
        self._sampling = True
        self._started = time.perf_counter()

    def on_oom(self, state: TrainerState, control: Control, *, error: BaseException) -> None:
        self._stop()

    def on_step_end(self, state: TrainerState, control: Control, *, metrics: dict[str, Any] | None) -> None:
        if not self._sampling:
            return
        seconds = time.perf_counter() - self._started
        forward_a2a, moe = moe_timer_seconds(self.layers)
        self._stop()
        self.samples.append({"step": state.step, "step_seconds": seconds, "a2a_seconds": 2 * forward_a2a,
                             "moe_forward_seconds": moe, "a2a_share": min(1.0, 2 * forward_a2a / seconds)})

    def _stop(self) -> None:
        stop_moe_timers(self.layers)
        self._sampling = False

    def a2a_share(self) -> float | None:
        if not self.samples:
            return None
        shares = sorted(s["a2a_share"] for s in self.samples)
        return shares[len(shares) // 2]

    def on_train_end(self, state: TrainerState, control: Control) -> None:
        if not self._num_experts:
            return
        latest = self.monitor.latest
        max_vio = latest.max_vio_max if latest is not None else None
        current = state.knobs.ep_size
        rec = recommend_ep_size(current, self._num_experts, state.world_size, self.a2a_share(), max_vio,
                                state.plan, self.config)
        self.recommendation = rec
        self.events.record(state.step, self.name, "recommend_ep_size", rec.reason,
                           signals={"a2a_share": self.a2a_share(), "samples": len(self.samples),
                                    "max_vio_max": max_vio, "world_size": state.world_size,
                                    "num_experts": self._num_experts},
                           before={"ep_size": current}, after={"ep_size": rec.ep_size, "command": rec.command})

    def summary(self) -> dict[str, Any]:
        rec = self.recommendation
        return {"a2a_share": self.a2a_share(), "samples": list(self.samples)[-5:],
                "recommended_ep_size": rec.ep_size if rec else None, "reason": rec.reason if rec else None,
                "command": rec.command if rec else None}



POLICY = Policy(name="ep", config=EPAdviceConfig, build=EPAdvicePolicy)

__all__ = ["EPAdviceConfig", "EPAdvicePolicy", "Recommendation", "recommend_ep_size",
           "replan_command", "valid_ep_sizes"]
