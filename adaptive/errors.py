"""The one exception type for user mistakes, and the close-match helper its messages use."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable


class AdaptiveError(ValueError):
    """Bad user input. The message is one line naming the value, the rule and a close valid choice.

    The CLI prints it and exits with code 2.
    """


def closest(value: str, choices: Iterable[str]) -> str | None:
    """The valid choice nearest to `value`, or None when nothing is close."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    match = difflib.get_close_matches(value.lower(), list(lowered), n=1, cutoff=0.5)
    return lowered[match[0]] if match else None


def unknown(kind: str, value: str, choices: Iterable[str]) -> AdaptiveError:
    """An error for a name that is not in `choices`, with a suggestion when one is close."""
    choices = sorted(choices)
    near = closest(value, choices)
    hint = f"; did you mean {near}?" if near else f"; choose one of {', '.join(choices)}"
    return AdaptiveError(f"unknown {kind} {value!r}{hint}")


def require_positive(name: str, value: float | int | None) -> None:
    """Reject zero, negative and non-finite numbers (nan, inf) for quantities that must be positive."""
    if value is None:
        return
    if math.isnan(value) or value <= 0:
        raise AdaptiveError(f"{name} must be positive, got {value}")
    if math.isinf(value):
        raise AdaptiveError(f"{name} must be a finite number, got {value}")
