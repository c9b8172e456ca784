"""The loop's contract as the policies' type hints name it.

The policies are plugins of the training loop: each implements, by name, the events of
`adaptive.train.run.callbacks.Callback` it needs (and `state_dict`/`load_state_dict` when it keeps
state), and the loop's `CallbackList` calls them. The loop owns the contract; the orchestrator
imports nothing from `adaptive.train`, so these names are for readers only.
"""

from typing import Any

TrainerState = Any  # adaptive.train.run.callbacks.TrainerState: what the loop lets a callback read
Control = Any  # adaptive.train.run.callbacks.Control: what a callback may ask of the loop
Knobs = Any  # adaptive.train.run.callbacks.Knobs: the training settings in force (`Knobs.RUNTIME` may change)

__all__ = ["Control", "Knobs", "TrainerState"]
