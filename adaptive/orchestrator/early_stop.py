"""Early stopping: end the run (checkpointed) when the eval loss stops improving.

After each eval, the loss counts as an improvement when it is below the best so far by more than
`min_delta`; after `patience` evals in a row without one, the policy asks the loop to stop (the loop
checkpoints and exports as at any stop). Evals come from `--eval-every` (a run that evaluates only at
its end never stops early). The best loss and the count survive a resume or a rollback.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from adaptive.orchestrator.contract import Control, TrainerState
from adaptive.orchestrator.events import EventLog
from adaptive.orchestrator.registry import Policy, require


@dataclass(frozen=True)
class EarlyStopConfig:
    patience: int = 5  # evals in a row without improvement
    min_delta: float = 0.0  # how much lower than the best an eval loss must be to count

    def __post_init__(self) -> None:
        require(self.patience >= 1, f"patience must be >= 1, got {self.patience}")
        require(self.min_delta >= 0, f"min_delta must be >= 0, got {self.min_delta}")


class EarlyStopPolicy:
    name = "early_stop"

    def __init__(self, events: EventLog, config: EarlyStopConfig | None = None) -> None:
        self.config = config or EarlyStopConfig()
        self.events = events
        self.best: float | None = None
        self.stale = 0  # evals since the last improvement

    def on_eval(self, state: TrainerState, control: Control, *, metrics: dict[str, Any]) -> None:
        loss = metrics.get("eval_loss")
        if loss is None or not math.isfinite(loss):
            return
        if self.best is None or loss < self.best - self.config.min_delta:
            self.best, self.stale = loss, 0
            return
        self.stale += 1
        if self.stale >= self.config.patience:
            control.should_stop = True
            self.events.record(state.step, self.name, "stop", f"eval loss {loss:.4f} has not improved on "
                               f"{self.best:.4f} by more than {self.config.min_delta:g} for {self.stale} evals",
                               signals={"eval_loss": loss, "best": self.best, "stale": self.stale})

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "stale": self.stale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best, self.stale = state_dict.get("best"), int(state_dict.get("stale", 0))

    def summary(self) -> dict[str, Any]:
        return {"best_eval_loss": self.best, "evals_without_improvement": self.stale}


POLICY = Policy(name="early_stop", config=EarlyStopConfig,
                build=lambda monitor, events, config: EarlyStopPolicy(events, config))

__all__ = ["EarlyStopConfig", "EarlyStopPolicy"]
