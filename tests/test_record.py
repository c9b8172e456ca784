"""adaptive.record: a record behaves as @dataclass(frozen=True) does (equality, hash values, repr, frozen)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from adaptive.record import record


@record
class Point:
    x: int
    y: tuple = ()
    label: str | None = None
    extra: object = None


Rec = Point
Plain = dataclasses.dataclass(frozen=True)(type("Point", (), {"__annotations__": dict(Point.__annotations__),
                                                                "y": (), "label": None, "extra": None}))


@pytest.mark.parametrize("args", [(1,), (2, (1, "a"), "p"), (0, (), None, 3.5)])
def test_a_record_compares_hashes_and_prints_as_a_frozen_dataclass(args):
    r, p = Rec(*args), Plain(*args)
    assert repr(r) == repr(p)
    assert hash(r) == hash(p)  # the fields' tuple: a record keys the same dict slots
    assert r == Rec(*args) and r != Rec(99) and r != p  # a different class never compares equal
    assert (r == 1) is False and r.__eq__(1) is NotImplemented
    assert dataclasses.replace(r, x=5) == Rec(5, *args[1:])
    assert dataclasses.asdict(r) == dataclasses.asdict(p)
    assert pickle.loads(pickle.dumps(r)) == r
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.x = 3


def test_a_record_keeps_what_its_class_defines_and_repr_survives_a_cycle():
    @record
    class Spec:
        a: int

        def __hash__(self) -> int:
            return 7

    assert hash(Spec(1)) == 7 and Spec(1) == Spec(1)

    @record
    class Box:
        items: list

    box = Box([])
    box.items.append(box)
    assert repr(box).endswith(".Box(items=[...])")


def test_an_unhashable_field_makes_an_unhashable_record():
    @record
    class Parts:
        parts: dict

    with pytest.raises(TypeError, match="unhashable"):
        hash(Parts({}))
