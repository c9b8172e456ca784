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


# pydantic error types -> the rule in our words (the message otherwise, without pydantic's "Value error, ")
_RULES = {"int_type": "must be an integer", "int_from_float": "must be an integer",
          "float_type": "must be a number", "finite_number": "must be a finite number",
          "bool_type": "must be true or false", "string_type": "must be a string", "list_type": "must be a list",
          "dict_type": "must be an object", "model_type": "must be an object",
          "model_attributes_type": "must be an object", "extra_forbidden": "is not a known key"}


def from_validation(where: str, error: object, known: Iterable[str] = ()) -> AdaptiveError:
    """One line for the first error of a pydantic `ValidationError` (taken duck-typed, so this module
    imports no pydantic): `where: field rule, got value`. `known` names the valid keys for a typo hint."""
    first = error.errors()[0]  # type: ignore[attr-defined]
    field = ".".join(str(p) for p in first["loc"])
    kind, ctx = first["type"], first.get("ctx") or {}
    if kind == "missing":
        return AdaptiveError(f"{where} lacks {field!r}")
    if kind == "greater_than":
        rule = "must be positive" if ctx.get("gt") == 0 else f"must be greater than {ctx.get('gt')}"
    elif kind in ("greater_than_equal", "less_than_equal", "less_than"):
        bound = ctx.get("ge", ctx.get("le", ctx.get("lt")))
        rule = {"greater_than_equal": "must be at least", "less_than_equal": "must be at most",
                "less_than": "must be less than"}[kind] + f" {bound}"
    elif kind == "literal_error":
        rule = "must be " + first["msg"].removeprefix("Input should be ")
    else:
        rule = _RULES.get(kind) or first["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if kind == "extra_forbidden":
        near = closest(str(first["loc"][-1]), known)
        return AdaptiveError(f"{where}: {field} {rule}{f'; did you mean {near}?' if near else ''}")
    if not field:  # a rule across fields: its message names them
        return AdaptiveError(f"{where}: {rule}")
    got = repr(first["input"])
    return AdaptiveError(f"{where}: {field} {rule}, got {got if len(got) <= 60 else got[:57] + '...'}")
