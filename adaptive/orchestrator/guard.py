"""Loss-spike / NaN guard: skip bad steps; after K of them in a window, roll back and cool the LR.

A bad step is
- a non-finite loss: the loop already skips such a step itself (its non-finite check rides on the
  one small all-reduce it makes every step, so the guard adds no host sync): the gradients are
  discarded, no update is applied, and `state.last_skip` says "discarded". The guard counts it;
- a loss spike, seen on a monitor summary: the window's mean loss above `spike_ratio` x the
  median of the last `history` summaries (once there are `min_history` of them). Its update was
  already applied; it counts towards the rollback.

When `bad_steps` (K) bad steps fall within the last `window` (W) optimizer steps, the guard asks
the loop to roll back to the newest complete checkpoint and sets the LR to `lr_factor` x the
schedule for the next `lr_steps` (M) steps, then back to 1x. After `max_rollbacks` rollbacks it
stops the run (checkpointed) instead of looping. Without any checkpoint yet it lowers the LR and
goes on. Skips requested by other callbacks also count as bad steps; DeepSpeed's fp16 overflow
skips (loss scaling) do not.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from adaptive.orchestrator.registry import Policy, require
from adaptive.orchestrator.contract import Control, TrainerState
from adaptive.orchestrator.events import EventLog
from adaptive.orchestrator.monitor import Monitor


@dataclass(frozen=True)
class GuardConfig:
    bad_steps: int = 3  # K
    window: int = 50  # W optimizer steps
    lr_factor: float = 0.5
    lr_steps: int = 100  # M optimizer steps at the lowered LR
    spike_ratio: float = 2.0
    history: int = 10
    min_history: int = 5
    max_rollbacks: int = 3

    def __post_init__(self) -> None:
        require(1 <= self.bad_steps <= self.window, f"need 1 <= bad_steps <= window, got {self.bad_steps} and {self.window}")
        require(0 < self.lr_factor <= 1, f"lr_factor must be in (0, 1], got {self.lr_factor}")
        require(self.lr_steps >= 0, f"lr_steps must be >= 0, got {self.lr_steps}")
        require(self.spike_ratio > 1, f"spike_ratio must be > 1, got {self.spike_ratio}")
        require(1 <= self.min_history <= self.history, "need 1 <= min_history <= history, got "
                f"{self.min_history} and {self.history}")
        require(self.max_rollbacks >= 0, f"max_rollbacks must be >= 0, got {self.max_rollbacks}")


class GuardPolicy:
    name = "guard"

    def __init__(self, monitor: Monitor, events: EventLog, config: GuardConfig | None = None) -> None:
        self.config = config or GuardConfig()
        self.monitor = monitor
        self.events = events
        self.bad: list[int] = []  # steps of bad steps since the last rollback
        self.losses: list[float] = []  # recent summarised losses
        self.rollbacks = 0
        self.skips = 0
        self.spikes = 0
        self.cool_until: int | None = None

    def on_train_start(self, state: TrainerState, control: Control) -> None:
        if state.lr_scale != 1.0:  # resumed during a cool-down: finish it
            self.cool_until = state.step + self.config.lr_steps

    def on_step_end(self, state: TrainerState, control: Control, *, metrics: dict[str, Any] | None) -> None:
        cfg = self.config
        step = state.step
        if state.last_skip == "discarded":
            self.skips += 1
            self._bad(step, "skip", "the step's loss was not finite (or a callback asked): gradients discarded, "
                      "no update", {"skipped_steps": state.skipped_steps})
        signals = self.monitor.fresh(state)
        if signals is not None and signals.loss is not None:
            recent = self.losses[-cfg.history:]
            if len(recent) >= cfg.min_history and signals.loss > cfg.spike_ratio * statistics.median(recent):
                self.spikes += 1
                self._bad(step, "spike", f"loss {signals.loss:.4g} > {cfg.spike_ratio:g} x median "
                          f"{statistics.median(recent):.4g} of the last {len(recent)} summaries",
                          {"loss": signals.loss, "median": statistics.median(recent)})
            else:
                self.losses = [*self.losses[-(cfg.history - 1):], signals.loss] if cfg.history > 1 else [signals.loss]
        self.bad = [s for s in self.bad if s > step - cfg.window]
        if len(self.bad) >= cfg.bad_steps:
            self._act(state, control)
        elif self.cool_until is not None and step >= self.cool_until:
            control.lr_scale = 1.0
            self.cool_until = None
            self.events.record(step, self.name, "restore_lr", f"{cfg.lr_steps} steps at the lowered LR done",
                               before={"lr_scale": state.lr_scale}, after={"lr_scale": 1.0})

    def _bad(self, step: int, action: str, reason: str, signals: dict[str, Any]) -> None:
        self.bad.append(step)
        cfg = self.config
        self.events.record(step, self.name, action, reason,
                           signals={**signals, "bad_steps_in_window": len([s for s in self.bad
                                                                            if s > step - cfg.window])})

    def _act(self, state: TrainerState, control: Control) -> None:
        cfg = self.config
        signals = {"bad_steps": list(self.bad), "window": cfg.window, "k": cfg.bad_steps}
        self.bad = []
        if self.rollbacks >= cfg.max_rollbacks:
            control.should_stop = True
            self.events.record(state.step, self.name, "stop", f"{self.rollbacks} rollbacks did not help: "
                               "stopping (checkpointed)", signals=signals)
            return
        before = {"step": state.step, "lr_scale": state.lr_scale}
        checkpoint = state.last_checkpoint
        control.lr_scale = cfg.lr_factor
        if checkpoint is None:
            self.cool_until = state.step + cfg.lr_steps
            self.events.record(state.step, self.name, "lower_lr", "no checkpoint to roll back to yet",
                               signals=signals, before=before, after={"lr_scale": cfg.lr_factor,
                                                                      "until_step": self.cool_until})
            return
        control.rollback_to_checkpoint = True
        self.rollbacks += 1
        target = state.last_checkpoint_step
        self.cool_until = target + cfg.lr_steps
        self.losses = []
        self.events.record(state.step, self.name, "rollback", f"{cfg.bad_steps} bad steps within {cfg.window} "
                           f"steps: back to the newest checkpoint, LR x{cfg.lr_factor:g} for {cfg.lr_steps} steps",
                           signals=signals, before=before,
                           after={"step": target, "checkpoint": str(checkpoint), "lr_scale": cfg.lr_factor,
                                  "until_step": self.cool_until})

    def summary(self) -> dict[str, Any]:
        return {"skips": self.skips, "spikes": self.spikes, "rollbacks": self.rollbacks}



POLICY = Policy(name="guard", config=GuardConfig, build=GuardPolicy)

__all__ = ["GuardConfig", "GuardPolicy"]
