"""A checkpoint state as it is written and read: its head (a format, a
version, the kind of pipeline), and the reading of its fields one by one.

A state comes from a file the user keeps (a checkpoint that may have been
edited, truncated or written by another program), so it is read as input
from elsewhere: each field's type and range are checked as it is read, the
error names the field and shows its value short, and fields left over are
refused (a state of another layout). What the fields mean is the
schedule's (shmpipe/_schedule.py).
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from typing import Any

from shmpipe.errors import ShmpipeTypeError, ShmpipeValueError

__all__ = ["STATE_FORMAT", "STATE_VERSION", "StateFields", "shown"]

#: Names a state as shmpipe's (a dict from somewhere else is refused).
STATE_FORMAT = "shmpipe.state"
#: The layout of the state dicts (shmpipe/_schedule.py); a later layout
#: reads this one or refuses it by name.
STATE_VERSION = 1

#: How a state's value is shown in an error: short, whatever it holds (a
#: list nested thousands deep in a pickled checkpoint would exhaust repr()).
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlist = 3, 80, 80, 8


def shown(value: Any) -> str:
    return _SHOWN.repr(value)


class StateFields:
    """A state dict read field by field: each read checks the type and the
    range and names the field in its error; done() refuses fields left
    over (a state of another layout)."""

    def __init__(self, state: Any, kind: str) -> None:
        if not isinstance(state, Mapping):
            raise ShmpipeTypeError(f"a state is a dict (from state_dict()), got {type(state).__name__}")
        self.state = dict(state)
        if any(type(k) is not str for k in self.state):
            raise ShmpipeValueError("malformed state: its keys must be strings (a state_dict() is JSON)")
        self.seen: set[str] = set()
        fmt = self.value("format")
        if type(fmt) is not str or fmt != STATE_FORMAT:
            raise ShmpipeValueError(f"not a shmpipe state (its 'format' is {shown(fmt)})")
        version = self.value("version")
        if type(version) is not int or version != STATE_VERSION:
            raise ShmpipeValueError(
                f"the state's version is {shown(version)}; this shmpipe reads version {STATE_VERSION}"
            )
        theirs = self.value("kind")
        if type(theirs) is not str or theirs != kind:
            raise ShmpipeValueError(f"the state is of a {shown(theirs)} pipeline, this one is {kind!r}")

    def value(self, name: str) -> Any:
        if name not in self.state:
            raise ShmpipeValueError(f"malformed state: no {name!r}")
        self.seen.add(name)
        return self.state[name]

    def integer(self, name: str, low: int, high: int) -> int:
        v = self.value(name)
        if type(v) is not int or not low <= v <= high:
            raise ShmpipeValueError(f"malformed state: {name!r} must be an int in [{low}, {high}], got {shown(v)}")
        return v

    def text(self, name: str) -> str:
        v = self.value(name)
        if type(v) is not str or len(v) > 256:
            raise ShmpipeValueError(f"malformed state: {name!r} must be a short string, got {shown(v)}")
        return v

    def integers(self, name: str, count: int | None, low: int, high: int) -> list[int]:
        v = self.value(name)
        if not isinstance(v, list) or (count is not None and len(v) != count):
            want = "a list" if count is None else f"a list of {count}"
            raise ShmpipeValueError(f"malformed state: {name!r} must be {want} ints, got {shown(v)}")
        for x in v:
            if type(x) is not int or not low <= x <= high:
                raise ShmpipeValueError(f"malformed state: {name!r} holds {shown(x)}, not an int in [{low}, {high}]")
        return list(v)

    def done(self) -> None:
        extra = sorted(set(self.state) - self.seen)
        if extra:
            raise ShmpipeValueError(f"malformed state: unknown fields {extra}")
