"""The batch contract (shmpipe._batch): one check for every transport, and
the shm codec, which checks on its own as it plans a payload, refuses the
same batches with the same error, word for word. (That every transport
refuses them in a pipeline is in the conformance suite.)"""

from __future__ import annotations

import collections
import enum
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec_fuzz import arrays, scalars

import shmpipe
from shmpipe import _batch, _codec
from shmpipe.errors import BatchTypeError
from shmpipe.testing.batches import matrix, non_contiguous
from shmpipe.transport import check_batch


class Opaque:
    pass


class Flag(enum.IntFlag):
    A = 1


class Arrayish:
    def __array__(self, dtype=None, copy=None):
        return np.zeros(2)


def _loop():
    loop: list = []
    loop.append(loop)
    return loop


BAD = [
    ({"x": np.array([1, None], dtype=object)}, "batch['x']", "dtype"),
    ({"x": [1, 2, object()]}, "batch['x'][2]", "unsupported type builtins.object"),
    ({"x": [1, 2, {3: np.zeros(2)}]}, "batch['x'][2][3]", "dict keys must be str, not int"),
    ({"x": [1, 2, {1, 2}]}, "batch['x'][2]", "unsupported type builtins.set"),
    ({"x": [1, 2, Opaque()]}, "batch['x'][2]", f"unsupported type {__name__}.Opaque"),
    ((np.zeros(1), {"y": [np.ma.masked_array([1, 2], mask=[0, 1])]}), "batch[1]['y'][0]", "masked"),
    ({"od": collections.OrderedDict(a=1)}, "batch['od']", "subclass of dict"),
    ({"nt": collections.namedtuple("P", "x y")(1, 2)}, "batch['nt']", "subclass of tuple"),
    ({"t": np.array(["a"], dtype=np.dtypes.StringDType())}, "batch['t']", "dtype"),
    ({"f": np.zeros(2, [("a", "f4"), ("o", "O")])}, "batch['f']", "dtype"),
    ({"s": np.zeros(2, [("a", "f4"), ("o", "O")])[0]}, "batch['s']", "dtype"),
    ({"m": memoryview(b"ab")}, "batch['m']", "unsupported type builtins.memoryview"),
    ([Arrayish()], "batch[0]", "numpy.asarray"),
    ({"i": [True, Flag.A]}, "batch['i'][1]", f"unsupported type {__name__}.Flag"),
    ({"loop": _loop()}, "batch['loop']" + "[0]" * 64, "does it contain itself"),
]


@pytest.mark.parametrize(("batch", "path", "words"), BAD, ids=[p + " " + w for _, p, w in BAD])
def test_a_bad_batch_is_the_same_error_from_the_check_and_the_codec(batch, path, words):
    with pytest.raises(BatchTypeError) as checked:
        check_batch(batch)
    with pytest.raises(BatchTypeError) as encoded:
        _codec.encode(batch)
    for err in (checked.value, encoded.value):
        assert isinstance(err, TypeError) and isinstance(err, shmpipe.ShmpipeError)
        assert err.path == path and words in err.message
    assert str(checked.value) == str(encoded.value)


def test_good_batches_pass():
    for name, batch in [*matrix(), ("non-contiguous", non_contiguous())]:
        assert check_batch(batch) is None, name
    check_batch({"memmap-like": np.arange(4).view(np.memmap), "deep": _nest(_batch.MAX_DEPTH)})


def _nest(depth: int) -> list:
    out: list = [np.zeros(1)]
    for _ in range(depth - 2):  # the root dict and the leaf take one level each
        out = [out]
    return out


def test_the_depth_limit_is_the_codecs():
    ok = {"d": _nest(_batch.MAX_DEPTH)}
    check_batch(ok)
    _codec.encoded_size(ok)
    too_deep = {"d": [_nest(_batch.MAX_DEPTH)]}
    for refuse in (check_batch, _codec.encoded_size):
        with pytest.raises(BatchTypeError, match="nested more than 64"):
            refuse(too_deep)


# -- at random: the check and the codec agree on every batch ---------------------

EXAMPLES = int(os.environ.get("SHMPIPE_FUZZ_EXAMPLES", "300"))

bad_leaves = st.sampled_from(
    [
        {1},
        object(),
        Opaque(),
        np.array([None]),
        np.zeros(1, [("o", "O")]),
        collections.OrderedDict(),
        memoryview(b""),
        1j,
        np.ma.masked_array([1.0]),
        np.array(["s"], dtype=np.dtypes.StringDType()),
    ]
)

maybe_bad = st.recursive(
    arrays() | scalars | bad_leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=4) | st.integers(0, 3), children, max_size=4),
    ),
    max_leaves=12,
)


@settings(
    max_examples=EXAMPLES,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(maybe_bad)
def test_the_check_and_the_codec_agree(batch):
    def outcome(fn):
        try:
            fn(batch)
        except BatchTypeError as err:
            return str(err)
        return None

    assert outcome(check_batch) == outcome(_codec.encoded_size)
