"""The one walker of nested batches (shmpipe._tree)."""

import gc
import json
import weakref

import numpy as np
import pytest

from shmpipe import _tree

NESTED = {"a": np.arange(3), "b": [1, (2.5, None), {"c": "text"}], "d": ()}


def test_leaves_and_their_paths_in_order():
    assert [p for p, _ in _tree.leaves_with_paths(NESTED)] == [
        "batch['a']",
        "batch['b'][0]",
        "batch['b'][1][0]",
        "batch['b'][1][1]",
        "batch['b'][2]['c']",
    ]
    assert [leaf for _, leaf in _tree.leaves_with_paths(NESTED)][1:] == list(_tree.leaves(NESTED))[1:]


def test_map_keeps_container_types_unless_told_to_make_tuples():
    mapped = _tree.map_leaves(NESTED, lambda leaf: "x")
    assert mapped == {"a": "x", "b": ["x", ("x", "x"), {"c": "x"}], "d": ()}
    paths = _tree.map_leaves_with_paths(NESTED, lambda leaf, path: path, lists_as_tuples=True)
    assert paths["b"] == ("batch['b'][0]", ("batch['b'][1][0]", "batch['b'][1][1]"), {"c": "batch['b'][2]['c']"})


def test_flatten_then_unflatten_rebuilds_the_batch():
    structure, leaves = _tree.flatten(NESTED)
    rebuilt = _tree.unflatten(structure, leaves)
    assert rebuilt.keys() == NESTED.keys() and rebuilt["b"] == NESTED["b"] and rebuilt["d"] == ()
    assert rebuilt["a"] is NESTED["a"]
    assert type(rebuilt["b"][1]) is tuple


def test_flatten_refuses_keys_that_are_not_str():
    with pytest.raises(TypeError, match=r"batch\['x'\]\[1\]: dict keys must be str"):
        _tree.flatten({"x": {1: 2}})


@pytest.mark.parametrize(
    "structure, leaves, words",
    [
        ("*", [], "more leaves"),
        ("*", [1, 2], "fewer"),
        (["d", ["k"], []], [], "do not match"),
        (["d", [1], ["*"]], [0], "do not match"),
        (["d", ["k", "k"], ["*", "*"]], [0, 1], "repeats a key"),  # {"k": 1}, a child dropped
        (["q", []], [], "malformed"),
        ([], [], "malformed"),
        ({"d": 1}, [], "malformed"),
        (["l", "*"], [1], "malformed"),
        (["l", [["l", []]] * 2], [], None),  # fine: two empty lists
    ],
)
def test_unflatten_reports_a_malformed_structure(structure, leaves, words):
    if words is None:
        assert _tree.unflatten(structure, leaves) == [[], []]
        return
    with pytest.raises(ValueError, match=words):
        _tree.unflatten(structure, leaves)


def test_a_leaf_that_is_the_leaf_marker_itself():
    # "*" marks a leaf in a structure; a leaf may be the str "*" too (read
    # back from JSON it is the very object of the marker: CPython keeps one
    # of each one-character str). It used to count as "no more leaves".
    structure, leaves = _tree.flatten(["*", {"k": "*"}])
    leaves = [json.loads('"*"') for _ in leaves]
    assert _tree.unflatten(structure, leaves) == ["*", {"k": "*"}]
    with pytest.raises(ValueError, match="fewer"):
        _tree.unflatten("*", ["*", "*"])


def test_unflatten_refuses_nesting_deeper_than_the_limit():
    deep = "*"
    for _ in range(_tree.MAX_DEPTH + 1):
        deep = ["l", [deep]]
    with pytest.raises(ValueError, match="nested more than"):
        _tree.unflatten(deep, [0])


def test_walking_keeps_no_reference_to_the_leaves():
    # Batches hold slots: a reference cycle left behind by the walk would
    # keep a slot until the garbage collector happens to run.
    gc.disable()
    try:
        arr = np.zeros(4)
        ref = weakref.ref(arr)
        structure, leaves = _tree.flatten({"x": [arr]})
        batch = _tree.unflatten(structure, leaves)
        _tree.map_leaves_with_paths(batch, lambda leaf, path: leaf)
        del arr, leaves, batch
        assert ref() is None
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "got, words",
    [
        ({"a": (np.arange(3),), "b": 1.5}, "nesting"),  # list became a tuple
        ({"b": 1.5, "a": [np.arange(3)]}, "nesting"),  # keys in another order
        ({"a": [np.arange(3, dtype=np.int32)], "b": 1.5}, "dtype"),
        ({"a": [np.arange(1, 4)], "b": 1.5}, "bytes differ"),
        ({"a": [np.arange(3)], "b": 1}, "is not"),
        ({"a": [np.arange(3)], "b": float("nan")}, "!="),
    ],
)
def test_assert_same_catches_each_kind_of_difference(got, words):
    from shmpipe.testing.assertions import assert_same

    want = {"a": [np.arange(3)], "b": 1.5}
    assert_same({"a": [np.arange(3)], "b": 1.5}, want)
    with pytest.raises(AssertionError, match=words):
        assert_same(got, want)
