"""Capacity adaptation: the MoE capacity factor follows the dropped-token fraction, within the
memory the plan allows.

On each monitor summary (every N steps), with `dropped` the worst layer's dropped fraction:

    dropped > raise_above for `patience` summaries in a row  ->  factor += step, capped at the bound
    dropped <= lower_below and memory is tight, `patience` summaries in a row  ->  factor -= step,
                                                                   not below min_factor

The factor is set on every MoE gate (`gate.capacity_factor`: our native gate and DeepSpeed's
TopKGate subclass both route with it). The bound is the largest factor on the grid
min_factor, min_factor + step, ... <= max_factor whose planned per-GPU peak (the planner's memory
model, `adaptive.plan.estimate.memory.estimate_memory`, for the run's setup with the knobs in force) stays
within the budget: `memory_budget_bytes`, or the plan's GPU memory. Memory is "tight" when the
measured CUDA peak (when the loop reports one) or else the planned peak at the current factor is
above `tight_fraction` of the budget.

The factor in force is kept in each checkpoint (the policy's `state_dict`), so `--resume` starts
from it, and a rollback returns to the factor that went with the restored weights (an event
"restore_capacity" says so when the factor changes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from adaptive.orchestrator.balance import moe_gates
from adaptive.orchestrator.registry import Policy, require
from adaptive.orchestrator.contract import Control, Knobs, TrainerState
from adaptive.orchestrator.events import EventLog
from adaptive.orchestrator.monitor import Monitor

GRID_TOLERANCE = 1e-9


@dataclass(frozen=True)
class CapacityConfig:
    raise_above: float = 0.01  # dropped fraction (worst layer) that asks for more capacity
    lower_below: float = 0.0  # "nothing drops"
    patience: int = 2  # summaries in a row before acting
    step: float = 0.25  # capacity-factor change per action
    min_factor: float = 1.0
    max_factor: float = 4.0
    memory_budget_bytes: int | None = None  # default: the plan's GPU memory
    tight_fraction: float = 0.9

    def __post_init__(self) -> None:
        require(0 <= self.lower_below <= self.raise_above < 1, "need 0 <= lower_below <= raise_above < 1, got "
                f"{self.lower_below} and {self.raise_above}")
        require(self.patience >= 1, f"patience must be >= 1, got {self.patience}")
        require(self.step > 0, f"step must be positive, got {self.step}")
        require(0 < self.min_factor <= self.max_factor, f"need 0 < min_factor <= max_factor, got {self.min_factor} "
                f"and {self.max_factor}")
        require(self.memory_budget_bytes is None or self.memory_budget_bytes > 0,
                f"memory_budget_bytes must be positive, got {self.memory_budget_bytes}")
        require(0 < self.tight_fraction <= 1, f"tight_fraction must be in (0, 1], got {self.tight_fraction}")


def planned_peak_bytes(plan: Any, knobs: Knobs | None, capacity_factor: float) -> int:
    """The planner's per-GPU peak for the run's setup at `capacity_factor` (pure, no torch)."""
    from adaptive.plan.estimate.memory import estimate_memory

    setup = plan.shown.setup
    if knobs is not None:
        setup = dataclasses.replace(setup, micro_batch_size=knobs.micro_batch_size, seq_len=knobs.seq_len,
                                    gradient_checkpointing=knobs.gradient_checkpointing,
                                    checkpoint_policy=None if knobs.checkpoint_policy in ("off", "full")
                                    else knobs.checkpoint_policy,
                                    gradient_accumulation_steps=knobs.gradient_accumulation_steps)
    return estimate_memory(dataclasses.replace(setup, capacity_factor=capacity_factor)).peak_gpu_bytes


def budget_bytes(plan: Any, config: CapacityConfig) -> int | None:
    if config.memory_budget_bytes is not None:
        return config.memory_budget_bytes
    gpu = getattr(getattr(plan, "request", None), "gpu", None)
    return getattr(gpu, "memory_bytes", None)


def capacity_grid(config: CapacityConfig) -> list[float]:
    out, value = [], config.min_factor
    while value <= config.max_factor + GRID_TOLERANCE:
        out.append(round(value, 6))
        value += config.step
    return out


def capacity_bound(plan: Any, knobs: Knobs | None, config: CapacityConfig) -> float:
    """The largest grid factor whose planned peak fits the budget (min_factor if none does;
    max_factor without a plan)."""
    budget = budget_bytes(plan, config)
    if plan is None or budget is None:
        return config.max_factor
    best = config.min_factor
    for factor in capacity_grid(config):
        if planned_peak_bytes(plan, knobs, factor) > budget:
            break  # the peak grows with the factor
        best = factor
    return best


class CapacityPolicy:
    name = "capacity"

    def __init__(self, monitor: Monitor, events: EventLog, config: CapacityConfig | None = None) -> None:
        self.config = config or CapacityConfig()
        self.monitor = monitor
        self.events = events
        self.gates: list[Any] = []
        self.factor: float | None = None
        self.bound: float | None = None
        self._bound_knobs: Knobs | None = None
        self._high = 0
        self._low = 0
        self._capped_reported = False
        self._planned: dict[tuple[Knobs, float], int] = {}
        self._restored: dict[str, Any] | None = None  # from a checkpoint loaded before on_train_start (--resume)

    def on_train_start(self, state: TrainerState, control: Control) -> None:
        self.gates = moe_gates(state.model)
        if self.gates:
            self.factor = float(self.gates[0].capacity_factor)
            if self._restored is not None:
                self._restore(state.step, self._restored, "resumed: the checkpoint's capacity factor")
                self._restored = None

    def state_dict(self) -> dict[str, Any] | None:
        # the streaks too: a resumed run acts at the same summary as the run that was never stopped
        return {"capacity_factor": self.factor, "high_streak": self._high, "low_streak": self._low} \
            if self.factor is not None else None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Applied before the next forward: in on_train_start (--resume) or on_step_start (a rollback)."""
        self._restored = dict(state_dict) if state_dict.get("capacity_factor") is not None else None

    def on_step_start(self, state: TrainerState, control: Control) -> None:
        if self._restored is not None and self.gates:
            self._restore(state.step, self._restored, "rolled back: the checkpoint's capacity factor")
            self._restored = None

    def _restore(self, step: int, saved: dict[str, Any], reason: str) -> None:
        factor = float(saved["capacity_factor"])
        self._high, self._low = int(saved.get("high_streak", 0)), int(saved.get("low_streak", 0))
        if self.factor is not None and abs(factor - self.factor) <= GRID_TOLERANCE:
            return
        before = self.factor
        for gate in self.gates:
            gate.capacity_factor = factor
        self.factor = factor
        self.events.record(step, self.name, "restore_capacity", reason,
                           before={"capacity_factor": before}, after={"capacity_factor": factor})

    def current_bound(self, state: TrainerState) -> float:
        if self.bound is None or self._bound_knobs != state.knobs:  # the OOM ladder may change knobs
            self.bound = capacity_bound(state.plan, state.knobs, self.config)
            self._bound_knobs = state.knobs
        return self.bound

    def on_step_end(self, state: TrainerState, control: Control, *, metrics: dict[str, Any] | None) -> None:
        signals = self.monitor.fresh(state)
        if signals is None or not self.gates or signals.dropped_fraction is None:
            return
        dropped = signals.dropped_max
        cfg = self.config
        self._high = self._high + 1 if dropped > cfg.raise_above else 0
        tight, memory = self._tight(state, signals)
        self._low = self._low + 1 if dropped <= cfg.lower_below and tight else 0
        bound = self.current_bound(state)
        seen = {"dropped_max": dropped, "dropped_fraction": signals.dropped_fraction, "bound": bound, **memory}
        if self.factor > bound + GRID_TOLERANCE:  # knobs changed under us (bigger micro-batch) or a low budget
            self._set(state, bound, "lower_capacity", f"the memory bound at the knobs in force is {bound:g}", seen)
        elif self._high >= cfg.patience:
            target = min(self.factor + cfg.step, bound)
            if target > self.factor + GRID_TOLERANCE:
                self._set(state, target, "raise_capacity",
                          f"dropped {dropped:.3f} > {cfg.raise_above:g} for {self._high} summaries", seen)
                self._capped_reported = False
            elif not self._capped_reported:
                self._capped_reported = True
                self.events.record(state.step, self.name, "capped",
                                   f"dropped {dropped:.3f} > {cfg.raise_above:g}, but {self.factor:g} is the "
                                   "memory bound", signals=seen, before={"capacity_factor": self.factor},
                                   after={"capacity_factor": self.factor})
            self._high = 0
        elif self._low >= cfg.patience:
            target = max(self.factor - cfg.step, cfg.min_factor)
            if target < self.factor - GRID_TOLERANCE:
                self._set(state, target, "lower_capacity", f"nothing dropped for {self._low} summaries and "
                          "memory is tight", seen)
            self._low = 0

    def _tight(self, state: TrainerState, signals: Any) -> tuple[bool, dict[str, Any]]:
        budget = budget_bytes(state.plan, self.config)
        if budget is None:
            return False, {}
        if signals.memory_peak_bytes is not None:
            used, how = signals.memory_peak_bytes, "measured"
        else:
            key = (state.knobs, self.factor)
            if key not in self._planned:  # the planner's arithmetic, once per knobs and factor
                self._planned[key] = planned_peak_bytes(state.plan, state.knobs, self.factor)
            used, how = self._planned[key], "planned"
        return used > self.config.tight_fraction * budget, {"memory_bytes": used, "memory_source": how,
                                                            "budget_bytes": budget}

    def _set(self, state: TrainerState, factor: float, action: str, reason: str, signals: dict[str, Any]) -> None:
        before = self.factor
        for gate in self.gates:
            gate.capacity_factor = factor
        self.factor = factor
        self.events.record(state.step, self.name, action, reason, signals=signals,
                           before={"capacity_factor": before}, after={"capacity_factor": factor})

    def summary(self) -> dict[str, Any]:
        return {"capacity_factor": self.factor, "bound": self.bound}



POLICY = Policy(name="capacity", config=CapacityConfig, build=CapacityPolicy)

__all__ = ["CapacityConfig", "CapacityPolicy", "capacity_bound", "capacity_grid", "planned_peak_bytes"]
