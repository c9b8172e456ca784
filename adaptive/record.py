"""`@record`: a frozen dataclass whose __eq__, __hash__ and __repr__ are shared functions, not compiled per class.

`@dataclass(frozen=True)` compiles six functions for each class when its module is imported (__init__,
__setattr__, __delattr__, __repr__, __eq__, __hash__). `adaptive fit` imports some 25 such classes (the run
configuration's sections, the planner's requests, setups, estimates and plans), and compiling their __repr__,
__eq__ and __hash__ took ~5% of its run (docs/BENCHMARKS.md). A record is the same frozen dataclass, but those
three read the class's fields at call time: the same results, the same hash values, nothing compiled. The cost
moves to each call (a loop over the fields), so a class hashed on a hot path (a cache key's, e.g.
parallel.Layout) stays a plain dataclass, or defines its own __hash__ (presets.ModelSpec).
"""

from __future__ import annotations

import dataclasses
from reprlib import recursive_repr
from typing import Any, TypeVar

T = TypeVar("T")


def record(cls: type[T]) -> type[T]:
    """`@dataclass(frozen=True)`, with dataclasses' __eq__, __hash__ and __repr__ semantics (Python 3.10-3.13)."""
    cls = dataclasses.dataclass(cls, frozen=True, eq=False, repr=False)  # type: ignore[assignment]
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    cls.__record_compare__ = tuple(f.name for f in fields if f.compare)  # type: ignore[attr-defined]
    cls.__record_hash__ = tuple(f.name for f in fields  # type: ignore[attr-defined]
                                if (f.compare if f.hash is None else f.hash))
    cls.__record_repr__ = tuple(f.name for f in fields if f.repr)  # type: ignore[attr-defined]
    own = cls.__dict__
    if "__eq__" not in own:  # as dataclass(): a method the class defines itself is kept
        cls.__eq__ = _eq  # type: ignore[assignment]
        if "__hash__" not in own or own["__hash__"] is None:
            cls.__hash__ = _hash  # type: ignore[assignment]
    if "__repr__" not in own:
        cls.__repr__ = _repr  # type: ignore[assignment]
    return cls


def _eq(self: Any, other: Any) -> bool:
    # field by field, as the tuples' == compares (identity first), stopping at the first difference: the planner's
    # caches compare their records' keys thousands of times a fit
    if other.__class__ is not self.__class__:
        return NotImplemented
    if other is self:
        return True
    for n in self.__record_compare__:
        a, b = getattr(self, n), getattr(other, n)
        if a is not b and not a == b:
            return False
    return True


def _hash(self: Any) -> int:
    return hash(tuple(getattr(self, n) for n in self.__record_hash__))


@recursive_repr()
def _repr(self: Any) -> str:
    return (f"{self.__class__.__qualname__}("
            + ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__record_repr__) + ")")


__all__ = ["record"]
