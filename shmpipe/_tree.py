"""Walking a batch: nested tuple, list and dict with leaves at the bottom.

The one walker of the package. A batch is a tree whose inner nodes are
exactly ``dict``, ``list`` and ``tuple`` (subclasses are leaves here: the
codec refuses them with a message, this module does not judge) and whose
leaves are anything else: arrays, scalars, ArraySpecs, tensors. Whoever
needs a batch's leaves, their paths, or the batch rebuilt with other leaves
uses these functions.

Paths are Python source for the place of a leaf, rooted at ``batch``:
``batch['image']``, ``batch[2][0]``; error messages name them.

A batch's *structure* (``flatten``) is plain JSON data, so a transport can
send it next to the leaves and ``unflatten`` rebuilds the batch::

    ["d", [key, ...], [child, ...]]   dict (keys in order)
    ["l", [child, ...]]               list
    ["t", [child, ...]]               tuple
    "*"                               a leaf (the next one in order)

``unflatten`` treats a structure as untrusted input: anything malformed is a
ValueError, and nesting deeper than MAX_DEPTH is refused, so a structure read
from shared memory can at worst be reported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

__all__ = [
    "MAX_DEPTH",
    "Structure",
    "flatten",
    "leaves",
    "leaves_with_paths",
    "map_leaves",
    "map_leaves_with_paths",
    "nbytes",
    "unflatten",
]

#: Deepest nesting a structure may have (the codec's limit too).
MAX_DEPTH = 64

#: JSON data describing a batch's nesting (see the module doc).
Structure = Any

_LEAF = "*"
# What next() gives past the last leaf: no value a leaf can be (not _LEAF:
# a leaf "*" read back from JSON is CPython's one-character str, that very object).
_NO_LEAF = object()


def leaves(batch: Any) -> Iterator[Any]:
    """Every leaf of `batch`, depth first, in order."""
    t = type(batch)
    if t is dict:
        for v in batch.values():
            yield from leaves(v)
    elif t is tuple or t is list:
        for v in batch:
            yield from leaves(v)
    else:
        yield batch


def leaves_with_paths(batch: Any, path: str = "batch") -> Iterator[tuple[str, Any]]:
    """(path, leaf) for every leaf of `batch`, depth first, in order."""
    t = type(batch)
    if t is dict:
        for k, v in batch.items():
            yield from leaves_with_paths(v, f"{path}[{k!r}]")
    elif t is tuple or t is list:
        for i, v in enumerate(batch):
            yield from leaves_with_paths(v, f"{path}[{i}]")
    else:
        yield path, batch


def map_leaves(batch: Any, fn: Callable[[Any], Any]) -> Any:
    """`batch` with ``fn(leaf)`` in place of each leaf; containers keep
    their types."""
    t = type(batch)
    if t is dict:
        return {k: map_leaves(v, fn) for k, v in batch.items()}
    if t is tuple or t is list:
        return t(map_leaves(v, fn) for v in batch)
    return fn(batch)


def map_leaves_with_paths(
    batch: Any, fn: Callable[[Any, str], Any], path: str = "batch", *, lists_as_tuples: bool = False
) -> Any:
    """`batch` with ``fn(leaf, path)`` in place of each leaf. With
    `lists_as_tuples` (tf.data's view: it has no lists), lists become
    tuples, and a list of strings (or of bytes) is one leaf, a NumPy array
    of them: the default collate gathers a string field into a list, one
    per sample, which tf.data holds as one string tensor of the batch's
    length (a tuple would have as many components as the batch has rows,
    and the last batch of an epoch may have fewer). The array holds the
    strings themselves (dtype object): NumPy's fixed-width ``S``/``U``
    dtypes would drop each value's trailing NUL bytes and pad every value
    to the longest."""
    t = type(batch)
    if t is dict:
        return {
            k: map_leaves_with_paths(v, fn, f"{path}[{k!r}]", lists_as_tuples=lists_as_tuples)
            for k, v in batch.items()
        }
    if t is list and lists_as_tuples and batch and all_strings(batch):
        return fn(_string_array(batch), path)
    if t is tuple or t is list:
        children = (
            map_leaves_with_paths(v, fn, f"{path}[{i}]", lists_as_tuples=lists_as_tuples) for i, v in enumerate(batch)
        )
        return tuple(children) if lists_as_tuples or t is tuple else list(children)
    return fn(batch, path)


def _string_array(items: list[Any]) -> np.ndarray:
    """`items` (strings, or bytes) as a 1-d NumPy array of those objects."""
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


def all_strings(items: Any) -> bool:
    """Whether `items` (a non-empty sequence) are all str, or all bytes."""
    kind = type(items[0])
    return (kind is str or kind is bytes) and all(type(item) is kind for item in items)


def nbytes(batch: Any) -> int:
    """Bytes of the arrays in `batch` (scalars count for nothing)."""
    return sum(leaf.nbytes for leaf in leaves(batch) if isinstance(leaf, np.ndarray))


# flatten and unflatten recurse through module-level functions, not nested
# ones: a nested function that calls itself is a reference cycle, and the
# cycle would keep the leaves (arrays, and so their slots) alive until the
# garbage collector runs.


def flatten(batch: Any) -> tuple[Structure, list[Any]]:
    """(structure, leaves) of `batch`: ``unflatten(*flatten(b))`` rebuilds
    `b`. Dict keys must be str (they go into JSON): TypeError otherwise."""
    out: list[Any] = []
    return _flatten(batch, "batch", out), out


def _flatten(node: Any, path: str, out: list[Any]) -> Structure:
    t = type(node)
    if t is dict:
        keys = list(node)
        for k in keys:
            if type(k) is not str:
                raise TypeError(f"{path}[{k!r}]: dict keys must be str, not {type(k).__name__}")
        return ["d", keys, [_flatten(node[k], f"{path}[{k!r}]", out) for k in keys]]
    if t is list or t is tuple:
        return ["l" if t is list else "t", [_flatten(v, f"{path}[{i}]", out) for i, v in enumerate(node)]]
    out.append(node)
    return _LEAF


def unflatten(structure: Structure, leaves: Sequence[Any]) -> Any:
    """The batch that `structure` describes, with `leaves` in order. Raises
    ValueError if the structure is malformed or does not use exactly
    ``len(leaves)`` leaves."""
    remaining = iter(leaves)
    batch = _unflatten(structure, remaining, 0)
    if next(remaining, _NO_LEAF) is not _NO_LEAF:
        raise ValueError(f"the structure uses fewer than the {len(leaves)} leaves given")
    return batch


def _unflatten(node: Structure, leaves: Iterator[Any], depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError(f"the structure is nested more than {MAX_DEPTH} levels deep")
    if node == _LEAF:
        leaf = next(leaves, _NO_LEAF)
        if leaf is _NO_LEAF:
            raise ValueError("the structure has more leaves than were given")
        return leaf
    if type(node) is not list or not node:
        raise ValueError(f"malformed structure node {node!r:.60}")
    kind = node[0]
    if kind == "d" and len(node) == 3 and type(node[1]) is list and type(node[2]) is list:
        keys, children = node[1], node[2]
        if len(keys) != len(children) or any(type(k) is not str for k in keys):
            raise ValueError("a dict node's keys and children do not match")
        if len(set(keys)) != len(keys):  # flatten writes each key once: a repeat would drop a child
            raise ValueError("a dict node repeats a key")
        return {k: _unflatten(c, leaves, depth + 1) for k, c in zip(keys, children, strict=True)}
    if kind in ("l", "t") and len(node) == 2 and type(node[1]) is list:
        items = [_unflatten(c, leaves, depth + 1) for c in node[1]]
        return items if kind == "l" else tuple(items)
    raise ValueError(f"malformed structure node {node!r:.60}")
