"""The batch contract: what a batch may hold, on every transport.

A batch is any nesting of exactly ``tuple``, ``list`` and ``dict`` (keys
``str``) whose leaves are NumPy arrays of a fixed-size dtype that holds no
Python objects (any shape, any strides; not masked), NumPy scalars of such
a dtype, or ``int``, ``float``, ``bool``, ``str``, ``bytes`` and ``None``;
nested at most ``MAX_DEPTH`` levels deep.

:func:`check` holds a batch to it, and the texts of its errors live here
too: the shm codec, which checks the same things while it plans a payload
(it writes memory, so it refuses on its own), raises them with the same
words and paths. Whichever transport carries a batch, a bad one is the same
:class:`~shmpipe.BatchTypeError`. Who calls :func:`check` is in
docs/transports.md ("Who checks a batch").
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

from shmpipe._tree import MAX_DEPTH
from shmpipe.errors import BatchTypeError

__all__ = [
    "MASKED_ARRAY",
    "TOO_DEEP",
    "check",
    "container_subclass",
    "dtype_refused",
    "format_path",
    "key_not_str",
    "unsupported_type",
]

# -- the messages (the codec raises these too) ---------------------------------

TOO_DEEP = f"nested more than {MAX_DEPTH} levels deep (does it contain itself?)"

MASKED_ARRAY = "masked arrays cannot be carried (the mask would be lost); send .data and .mask as two arrays"


def key_not_str(key: Any) -> str:
    return f"dict keys must be str, not {type(key).__name__}"


def container_subclass(obj: Any) -> str:
    base = _base_name(obj)
    return (
        f"{type(obj).__name__} is a subclass of {base}; shmpipe carries plain "
        f"tuple, list and dict only (convert it with {base}(...))"
    )


def unsupported_type(obj: Any) -> str:
    t = type(obj)
    return (
        f"unsupported type {t.__module__}.{t.__qualname__}; a batch holds NumPy arrays, "
        "int, float, bool, str, bytes and None in tuples, lists and dicts with str keys"
        + (" (convert it with numpy.asarray)" if hasattr(obj, "__array__") else "")
    )


def dtype_refused(dt: np.dtype) -> str:
    return f"dtype {dt!r} cannot be carried: shmpipe carries fixed-size dtypes without Python objects"


def format_path(keys: Iterable[Any]) -> str:
    """``batch['x'][2]`` for the keys and indices ``'x', 2`` (outermost first)."""
    return "batch" + "".join(f"[{k!r}]" for k in keys)


def _base_name(obj: Any) -> str:
    for base in (dict, tuple, list):
        if isinstance(obj, base):
            return base.__name__
    return type(obj).__name__


# -- the check -----------------------------------------------------------------

_SCALARS = frozenset([int, float, bool, str, bytes, type(None)])


class _Refused(Exception):
    """Raised where a value breaks the contract; each container on the way
    out adds its key, so a good batch pays for no path at all."""

    def __init__(self, message: str, *keys: Any) -> None:
        self.message = message
        self.keys = list(keys)  # innermost first


def check(batch: Any) -> None:
    """Raises BatchTypeError, naming the path, if `batch` breaks the
    contract (see the module doc); returns None otherwise. One walk; the
    path is built only for a bad batch."""
    try:
        _check(batch, 0)
    except _Refused as refused:
        raise BatchTypeError(refused.message, format_path(reversed(refused.keys))) from None


def _check(obj: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise _Refused(TOO_DEEP)
    t = type(obj)
    if t is np.ndarray:
        _check_dtype(obj.dtype)
    elif t is dict:
        for key, value in obj.items():
            if type(key) is not str:
                raise _Refused(key_not_str(key), key)
            try:
                _check(value, depth + 1)
            except _Refused as refused:
                refused.keys.append(key)
                raise
    elif t is tuple or t is list:
        for i, value in enumerate(obj):
            try:
                _check(value, depth + 1)
            except _Refused as refused:
                refused.keys.append(i)
                raise
    elif t in _SCALARS:
        pass
    elif isinstance(obj, np.ndarray):
        ma = sys.modules.get("numpy.ma")  # loaded whenever a masked array exists
        if ma is not None and isinstance(obj, ma.MaskedArray):
            raise _Refused(MASKED_ARRAY)
        _check_dtype(obj.dtype)  # other subclasses (numpy.memmap) travel as plain arrays
    elif isinstance(obj, np.generic):
        _check_dtype(obj.dtype)
    elif isinstance(obj, (dict, tuple, list)):
        raise _Refused(container_subclass(obj))
    else:
        raise _Refused(unsupported_type(obj))


def _check_dtype(dt: np.dtype) -> None:
    # Object fields anywhere inside (hasobject), the object dtype itself, and
    # StringDType ("T": variable size, its bytes point elsewhere).
    if dt.hasobject or dt.kind in "OT":
        raise _Refused(dtype_refused(dt))
