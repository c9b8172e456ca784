"""Runtime adaptation: small callbacks the training loop calls (`adaptive.orchestrator.callbacks`).

This package holds the callback API only; policies (expert balancing, OOM ladder, NaN guard, ...)
plug in as `Callback` subclasses. `policies()` is the seam the recipes' entry point calls when the
orchestrator is on; it returns no policy yet.
"""

from __future__ import annotations

from adaptive.orchestrator.callbacks import Callback, CallbackList, Control, Knobs, TrainerState


def policies() -> list[Callback]:
    """The orchestrator's policies, in the order they run. None are implemented yet."""
    return []


__all__ = ["Callback", "CallbackList", "Control", "Knobs", "TrainerState", "policies"]
