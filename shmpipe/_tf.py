"""tf.data from a stream of batches, without a copy on the host.

``tf.data.Dataset.from_generator`` with an ``output_signature`` of TensorSpecs
hands each NumPy array to TensorFlow through ``numpy_function``, which
*aliases* an array whose data is 64-byte aligned (and copies it once
otherwise). The tensor then keeps the array alive, the array keeps its
batch's root, the root keeps the slot: the slot goes back to the ring only
when TensorFlow drops the tensor (after ``prefetch``, ``batch``, ``shuffle``
are done with it), never earlier.

tf.data buffers hold elements, and in the ring every element held is a slot
held. A buffer larger than the ring (``batch(8)`` over 4 slots, a big
``shuffle``) would hold every slot while it waits for more, and the producers
could never make more. So the generator copies an element instead of
aliasing it when TensorFlow holds more slots than the producers can spare
(ChannelSpec.consumer_may_hold) and does not let go of any within
RELEASE_WAIT_S: the pipeline slows to one copy per batch instead of
deadlocking, and a warning says which capacity would keep it zero-copy.
It waits once per pass: after TensorFlow kept its slots through one wait,
batches that would not fit are copied at once until the pass ends.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shmpipe._codec import aligned_empty
from shmpipe._stream import BatchStream, Pass, TrainerPosition
from shmpipe._tree import all_strings, leaves_with_paths, map_leaves_with_paths
from shmpipe.errors import (
    BatchTypeError,
    PipelineClosedError,
    ShmpipeValueError,
    ShmpipeWarning,
    as_int,
    out_of_range,
)

if TYPE_CHECKING:
    import tensorflow as tf


__all__ = ["to_tf_dataset", "tensorflow_aliases", "signature_of"]

#: How long a full ring may stay full before batches are copied for tf.data.
RELEASE_WAIT_S = 0.2
_alias_check: bool | None = None
_alias_lock = threading.Lock()


def tensorflow_aliases() -> bool:
    """Whether this TensorFlow aliases aligned NumPy arrays in from_generator
    (checked once per process, on a tiny array; warns if it does not)."""
    global _alias_check
    with _alias_lock:
        if _alias_check is None:
            import tensorflow as tf

            def through_from_generator(arr: np.ndarray) -> Any:
                spec = tf.TensorSpec(arr.shape, tf.as_dtype(arr.dtype))
                return next(iter(tf.data.Dataset.from_generator(lambda: iter([arr]), output_signature=spec)))

            # Eagerly, also where the first to_tf_dataset() of the process is
            # made inside a function TensorFlow traces (flat_map, tf.function):
            # there the check's tensor would be symbolic, with no buffer.
            with tf.init_scope():
                _alias_check = check_aliasing(through_from_generator)
        return _alias_check


def check_aliasing(to_tensor: Callable[[np.ndarray], Any]) -> bool:
    """Passes a 64-byte aligned array through `to_tensor` and tells whether
    the tensor is that array's memory; warns when it is not."""
    import tensorflow as tf

    raw = np.zeros(64 + 256, np.uint8)
    start = (-raw.ctypes.data) % 64
    arr = raw[start : start + 256].view(np.float32)
    tensor = to_tensor(arr)
    # Tensor.numpy() copies by design; _numpy() is the tensor's own buffer.
    aliased = tensor._numpy().ctypes.data == arr.ctypes.data
    if not aliased:
        warnings.warn(
            f"TensorFlow {tf.__version__} copies NumPy arrays passed through "
            "tf.data.Dataset.from_generator (earlier versions aliased 64-byte aligned "
            "ones): every batch now costs one copy on the host",
            ShmpipeWarning,
            stacklevel=3,
        )
    return aliased


def _spec_of_leaf(leaf: Any, path: str) -> Any:
    import tensorflow as tf

    if isinstance(leaf, np.ndarray) and (
        leaf.dtype.kind in "US" or (leaf.dtype == object and leaf.size and all_strings(leaf.ravel()))
    ):
        # NumPy strings; or Python ones, as a list of strings arrives here
        # (map_leaves_with_paths): TensorFlow encodes str as UTF-8
        return tf.TensorSpec(leaf.shape, tf.string)
    if isinstance(leaf, np.ndarray) or isinstance(leaf, np.generic):
        try:
            dtype = tf.as_dtype(leaf.dtype)
        except TypeError:
            raise BatchTypeError(f"TensorFlow has no dtype for {leaf.dtype!r}", path) from None
        return tf.TensorSpec(np.shape(leaf), dtype)
    if isinstance(leaf, bool):
        return tf.TensorSpec((), tf.bool)
    if isinstance(leaf, int):
        return tf.TensorSpec((), tf.int64)
    if isinstance(leaf, float):
        return tf.TensorSpec((), tf.float64)
    if isinstance(leaf, (str, bytes)):
        return tf.TensorSpec((), tf.string)
    raise BatchTypeError(
        f"tf.data cannot hold {type(leaf).__name__} values"
        + (" (None has no tensor; leave it out of the batch)" if leaf is None else ""),
        path,
    )


def _for_tensorflow(batch: Any, leaf_fn: Callable[[Any, str], Any]) -> Any:
    """`batch` with leaf_fn(leaf, path) at each leaf; lists become tuples
    (tf.data has no lists)."""
    return map_leaves_with_paths(batch, leaf_fn, lists_as_tuples=True)


def signature_of(*batches: Any) -> Any:
    """The output_signature for batches like these: their structure, dtypes
    and shapes, with None for every dimension that differs between them."""
    import tensorflow as tf

    if not batches:
        raise ShmpipeValueError("signature_of() needs at least one batch")
    specs = [_for_tensorflow(b, _spec_of_leaf) for b in batches]

    def merge(a: Any, b: Any) -> Any:
        if a.dtype != b.dtype or a.shape.rank != b.shape.rank:
            raise ShmpipeValueError(f"batches disagree: {a} vs {b}; pass output_signature yourself")
        return tf.TensorSpec(
            [x if x == y else None for x, y in zip(a.shape.as_list(), b.shape.as_list(), strict=True)], a.dtype
        )

    out = specs[0]
    for other in specs[1:]:
        try:
            out = tf.nest.map_structure(merge, out, other)
        except (ValueError, TypeError) as exc:
            raise ShmpipeValueError(
                f"batches differ in structure ({exc}); pass output_signature yourself"
            ) from None
    return out


def _first_axis_unknown(signature: Any) -> Any:
    import tensorflow as tf

    def relax(spec: Any) -> Any:
        if spec.shape.rank is None or spec.shape.rank == 0:
            return spec
        return tf.TensorSpec([None, *spec.shape.as_list()[1:]], spec.dtype, spec.name)

    return tf.nest.map_structure(relax, signature)


class _Owner:
    """What a dataset of to_tf_dataset() needs: its pipeline, and the pass
    begun to peek at its first batches. The dataset holds it (an attribute;
    datasets made from it, and their iterators, hold that one), and so does
    the pipeline (a dataset TensorFlow rebuilds from its graph, in a
    flat_map's function say, keeps no Python object); the generator
    function refers to it only weakly: TensorFlow keeps the functions of
    from_generator for the life of the process (eager mode files them with
    the global default graph), and a strong reference from there kept every
    such pipeline, closed or forgotten, from being collected: its ring
    stayed mapped, a forgotten one's producers ran on. (Pipeline and owner
    refer to each other: the collector takes both once neither is used.)"""

    __slots__ = ("__weakref__", "peeked", "pipe")

    def __init__(self, pipe: BatchStream, peeked: _Peeked | None) -> None:
        self.pipe, self.peeked = pipe, peeked

    def pass_began(self, pass_no: int) -> None:
        """The stream began pass `pass_no`: batches peeked of an earlier
        pass for a dataset not iterated yet can never be delivered (that
        pass is over: its iterator gives nothing more), and their slots go
        back now, not when the pipeline is collected (it keeps this owner).
        Such a dataset's first iteration runs a pass of its own, as a
        later one does."""
        peeked = self.peeked
        if peeked is not None and peeked.it.pass_no != pass_no:
            self.peeked = None


class _Feeder:
    """The generator function tf.data calls once per iteration: each call
    runs a new pass of the pipeline (the first may start with batches that
    were peeked to infer the signature)."""

    def __init__(self, owner: _Owner, signature: Any, inferred: bool) -> None:
        self._owner = weakref.ref(owner)
        pipe = owner.pipe
        # The most slots TensorFlow may hold with the producers still sure
        # to deliver the batch it waits for (see ChannelSpec.consumer_may_hold).
        self.limit = pipe.consumer_may_hold
        self.checked = _checker(signature, inferred)
        self.warned = False
        self.copying = False  # TensorFlow held every slot and did not let go
        # A wait of RELEASE_WAIT_S ended with TensorFlow still holding too
        # many this pass: its buffers hold more than the ring can lend (a
        # batch(n) with n above the limit fills and lets go once per n
        # elements), so waiting again would only stall each time; copy at
        # once instead. Each pass (epoch) starts over: one slow moment (the
        # first step's compilation) does not make a dataset copy for good.
        self.waited_in_vain = False

    def _live_owner(self) -> _Owner:
        owner = self._owner()
        if owner is None:
            raise PipelineClosedError(
                "the pipeline of this tf.data.Dataset was collected: nothing referred to the pipeline or to "
                "the dataset its to_tf_dataset() made any more (keep one of them while TensorFlow iterates)"
            )
        return owner

    @property
    def pipe(self) -> BatchStream:
        return self._live_owner().pipe

    def __call__(self) -> _FeederPass:
        self.waited_in_vain = False
        owner = self._live_owner()
        peeked, owner.peeked = owner.peeked, None
        if peeked is None:
            it = iter(self.pipe)
            assert isinstance(it, Pass)  # what a stream's iter() makes
            peeked = _Peeked(it, [], None)
        return _FeederPass(self, peeked)

    def _prepare(self, batch: Any) -> Any:
        if self._tensorflow_holds_too_many_slots():
            # Handing TensorFlow this batch's slot would leave the producers
            # too few: hand it a copy and free the slot, so they can go on.
            if not self.warned:
                self.warned = True
                pipe = self.pipe
                if pipe.ordered and pipe.num_workers > 1:
                    need = (
                        f"an ordered pipeline of {pipe.num_workers} workers may lend it at most "
                        f"{self.limit} of {pipe.capacity}, since each worker may fill "
                        f"(capacity - 1) // {pipe.num_workers} while the consumer waits for another"
                    )
                    advice = f"capacity >= {pipe.num_workers} * (what the dataset holds at once) + 1"
                else:
                    need = f"the producers need one of the {pipe.capacity} free"
                    advice = "capacity above what the dataset holds at once (batch size + prefetch + 2)"
                warnings.warn(
                    f"tf.data holds more slots of the ring than it can lend (its buffers: batch, "
                    f"prefetch, shuffle; {need}); shmpipe now copies batches that would not fit "
                    f"instead of waiting forever. Raise {advice} to keep it zero-copy.",
                    ShmpipeWarning,
                    stacklevel=2,
                )
            batch = copy_for_tensorflow(batch)
        return self.checked(batch)

    def _tensorflow_holds_too_many_slots(self) -> bool:
        """Whether the slots held, this batch's included, exceed the limit
        (and stay above it for RELEASE_WAIT_S)."""
        stream = self.pipe
        held = stream.held()
        if held is None or held <= self.limit:
            self.copying = False
            return False
        if not self.copying and not self.waited_in_vain:
            # tf.data's buffers (the prefetch TensorFlow adds by itself, for
            # one) fill and drain; a full ring is only a trap if nothing
            # drains. Give TensorFlow a moment to let go of a slot, once.
            deadline = time.monotonic() + RELEASE_WAIT_S
            while held > self.limit and time.monotonic() < deadline:
                time.sleep(0.002)
                held = stream.held() or 0
            self.waited_in_vain = held > self.limit
        self.copying = held > self.limit
        return self.copying


def _check_device(tf: Any, device: str) -> None:
    try:
        spec = tf.DeviceSpec.from_string(device)
    except (ValueError, TypeError) as exc:
        raise ShmpipeValueError(f"to_tf_dataset(device={device!r}): {exc}") from None
    kind = (spec.device_type or "").upper()
    if kind and kind != "CPU" and not tf.config.list_logical_devices(kind):
        # TensorFlow would place the elements on the CPU without a word.
        warnings.warn(
            f"to_tf_dataset(device={device!r}): TensorFlow sees no {kind} here, so the elements "
            "stay on the CPU",
            ShmpipeWarning,
            stacklevel=4,
        )


def copy_for_tensorflow(batch: Any) -> Any:
    """`batch` with each array copied to 64-byte aligned memory, which
    TensorFlow aliases: one copy in all. (ndarray.copy() would do for small
    arrays only: NumPy's larger allocations start 16 bytes into a page, and
    TensorFlow would copy them a second time.)"""

    def copy(leaf: Any, path: str) -> Any:
        if not isinstance(leaf, np.ndarray):
            return leaf
        if leaf.dtype.hasobject:
            return leaf.copy()  # Python objects: TensorFlow converts them anyway
        out = aligned_empty(leaf.nbytes).view(leaf.dtype).reshape(leaf.shape)
        out[...] = leaf
        return out

    return _for_tensorflow(batch, copy)


class _FeederPass:
    """One pass, as tf.data iterates it. An iterator object, not a
    generator: a suspended generator would keep the batch it yielded last
    (and its slot) alive until the next one -- and a batch copied for
    TensorFlow must give its slot back at once, or the last free slot would
    stay held."""

    __slots__ = ("feeder", "pass_")

    def __init__(self, feeder: _Feeder, pass_: _Peeked) -> None:
        self.feeder, self.pass_ = feeder, pass_

    def __iter__(self) -> _FeederPass:
        return self

    def __next__(self) -> Any:
        pass_ = self.pass_
        if not pass_.first:
            return self.feeder._prepare(next(pass_.it))
        batch = pass_.first.pop(0)
        if pass_.position is not None:
            pass_.position.had_one()  # tf.data has it: handed out, as every batch it takes
            if not pass_.first:
                self.feeder.pipe._adapter_caught_up(pass_.position)
        return self.feeder._prepare(batch)


@dataclass
class _Peeked:
    """A pass begun by to_tf_dataset, and the batches it took of it to
    infer the signature: tf.data is given those first. `position`: where
    the trainer stands meanwhile (it has had none of them)."""

    it: Pass
    first: list[Any]
    position: TrainerPosition | None


def _checker(signature: Any, inferred: bool) -> Callable[[Any], Any]:
    """A function that checks a batch against the signature, leaf by leaf
    (shape, that no leaf is missing, and, where the signature was inferred
    from the first batches, the dtype), and gives it as from_generator
    takes it: with the path in the error, where TensorFlow would convert a
    later batch's other dtype in silence (an int64 into the int32 of the
    first batches wraps, a float into an int truncates) or raise without
    saying where. A signature the user gave is TensorFlow's to convert to."""
    flat = dict(leaves_with_paths(signature))
    #: TensorFlow's dtype of each NumPy one met (tf.as_dtype for every leaf
    #: of every batch would cost more than the check); not object arrays,
    #: whose dtype depends on what they hold
    dtypes: dict[np.dtype, Any] = {}
    seen = [0]  # leaves of the batch being checked (check_batch counts them against the signature's)

    def check(leaf: Any, path: str) -> Any:
        spec = flat.get(path)
        if spec is None:
            raise ShmpipeValueError(
                f"{path} is not in the dataset's element_spec (the batches changed their "
                "structure); pass output_signature= to say what every batch holds"
            )
        seen[0] += 1
        if isinstance(leaf, np.ndarray) and leaf.dtype != object:
            dtype = dtypes.get(leaf.dtype)
            if dtype is None:
                dtype = dtypes[leaf.dtype] = _spec_of_leaf(leaf, path).dtype
        else:  # a scalar, None (refused here, with its path), an object array
            dtype = _spec_of_leaf(leaf, path).dtype
        if inferred and dtype != spec.dtype:
            got = leaf.dtype if isinstance(leaf, np.ndarray) else dtype.name
            raise ShmpipeValueError(
                f"{path} is {got}, but the dataset's element_spec says {spec.dtype.name} (inferred from the first "
                "batches; TensorFlow would convert it without a word, or fail without naming it); pass "
                "output_signature= with the dtype every batch fits, or make the batches alike"
            )
        if isinstance(leaf, np.ndarray) and not spec.shape.is_compatible_with(leaf.shape):
            raise ShmpipeValueError(
                f"{path} has shape {leaf.shape}, but the dataset's element_spec says "
                f"{tuple(spec.shape.as_list())} (inferred from the first batches); pass "
                "output_signature= with None for the dimensions that vary, e.g. "
                "shmpipe.signature_of(batch_a, batch_b)"
            )
        return leaf

    def check_batch(batch: Any) -> Any:
        seen[0] = 0
        out = _for_tensorflow(batch, check)
        if seen[0] != len(flat):
            present = {path for path, _ in leaves_with_paths(out)}
            missing = sorted(set(flat) - present)
            raise ShmpipeValueError(
                f"the batch has no {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}, which the dataset's "
                "element_spec holds (the batches changed their structure); pass output_signature= to say what "
                "every batch holds"
            )
        return out

    return check_batch


def to_tf_dataset(
    pipe: BatchStream,
    output_signature: Any = None,
    device: str | None = None,
    batches_per_pass: int | None = None,
    peek: int | None = None,
) -> tf.data.Dataset:
    import tensorflow as tf

    # The arguments first: a pass started to peek at batches moves the
    # stream's position.
    if device is not None:
        _check_device(tf, device)
    if batches_per_pass is not None:
        if (count := as_int(batches_per_pass)) is None or count < 1:
            raise out_of_range(f"batches_per_pass must be a positive int, got {batches_per_pass!r}", batches_per_pass)
        batches_per_pass = count
    tensorflow_aliases()  # warns once if this TensorFlow stopped aliasing
    peeked = None
    if output_signature is None:
        # Infer from the first batches of a pass; each worker's first batch
        # tells which dimensions vary. Those batches are yielded first.
        k = peek if peek is not None else max(1, min(pipe.num_workers, pipe.consumer_may_hold, 4))
        it = iter(pipe)
        assert isinstance(it, Pass)  # what a stream's iter() makes (its last_worker is read)
        # The trainer has had none of them: until tf.data has taken them,
        # the stream's state_dict() counts from this position (a run resumed
        # from a state made meanwhile lost the peeked batches).
        position = pipe._position_for_adapter(ahead=k)
        first: list[Any] = []
        while len(first) < k:
            try:
                first.append(pipe._take_ahead(it, position))
            except StopIteration:
                break
        if not first:
            raise ShmpipeValueError(
                "the sources produced no batch, so there is nothing to infer the dataset's "
                "element_spec from; pass output_signature="
            )
        output_signature = signature_of(*first)
        if pipe._batch_sizes_vary:
            # The first batches of a pass are full; the last may not be (a
            # dataset's partial batch): the batch axis is unknown, as with
            # tf.data's batch(drop_remainder=False).
            output_signature = _first_axis_unknown(output_signature)
        peeked = _Peeked(it, first, position)
    owner = _Owner(pipe, peeked)
    pipe._adapters_keep.append(owner)
    ds = tf.data.Dataset.from_generator(
        _Feeder(owner, output_signature, inferred=peeked is not None), output_signature=output_signature
    )
    if batches_per_pass is not None:
        # A known length: Keras then knows an epoch's steps (and does not warn
        # "Your input ran out of data" at the end of each one).
        ds = ds.apply(tf.data.experimental.assert_cardinality(batches_per_pass))
    if device is not None:
        # The final hop: TensorFlow copies each element to the device in the
        # background, so the copy overlaps the training step.
        ds = ds.apply(tf.data.experimental.prefetch_to_device(device))
    ds._shmpipe_owner = owner  # the dataset keeps its pipeline, TensorFlow's registry does not (_Owner)
    return ds

