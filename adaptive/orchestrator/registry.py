"""The orchestrator's policies: each is one module that ends with a `POLICY = Policy(...)` line, and
one line in `POLICIES` below. Importing this module imports no policy (and no torch)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

# name -> the module that defines it; policies run in this order, after the monitor
POLICIES: dict[str, str] = {
    "balance": "adaptive.orchestrator.balance",
    "capacity": "adaptive.orchestrator.capacity",
    "oom": "adaptive.orchestrator.oom",
    "guard": "adaptive.orchestrator.guard",
    "ep": "adaptive.orchestrator.ep_advice",
    "early_stop": "adaptive.orchestrator.early_stop",
}


@dataclass(frozen=True)
class Policy:
    """A policy as the registry knows it: its settings dataclass (validated in `__post_init__`) and
    how to build its callback from the shared monitor, the event log and those settings."""

    name: str
    config: type
    build: Callable[[Any, Any, Any], Any]  # (monitor, events, config) -> the callback


def policy(name: str) -> Policy:
    found = importlib.import_module(POLICIES[name]).POLICY
    assert found.name == name, f"{POLICIES[name]} registers {found.name!r}, not {name!r}"
    return found


def require(ok: bool, message: str) -> None:
    """A settings rule; pydantic reports the ValueError with the field's section."""
    if not ok:
        raise ValueError(message)


__all__ = ["POLICIES", "Policy", "policy", "require"]
