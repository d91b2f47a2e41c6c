"""Where a batch's leaves go in JAX, and how: the device or the sharding's
devices (``Target``), the checks of each new shape and dtype of leaf before
the first step (``Target._plan``), and the call that puts a leaf there,
worked out once per shape and dtype (``_Plan``) and checked once per
process and platform against ``jax.device_put`` (``_probe``). The lifetime
rules these keep are _jax.py's (its module doc); what a first batch copies
on the host is said once (``warn_about_copies``).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from shmpipe._tree import leaves_with_paths
from shmpipe.errors import BatchTypeError, ShmpipeTypeError, ShmpipeValueError, ShmpipeWarning

__all__ = ["ALIGNMENT", "COPY_WARN_BYTES", "Target", "Unplanned", "collector", "warn_about_copies"]

#: A leaf at least this large that JAX copies on the host earns a warning
#: (smaller copies, a batch's int64 labels, cost microseconds).
COPY_WARN_BYTES = 1 << 20
#: The alignment XLA's CPU client needs to alias host memory (measured: an
#: array 4, 8, 16 or 32 bytes off a 64-byte boundary is copied).
ALIGNMENT = 64


@functools.cache  # (one hook per stream, however many to_jax() calls: call_while_waiting)
def collector() -> Callable[[], Any]:
    """jaxlib's collection of the host arrays JAX no longer needs; where it
    is gone, a collection of Python's youngest generation, which runs it
    (JAX's gc callback)."""
    try:
        from jax._src.lib import _jax

        collect: Callable[[], Any] = _jax.collect_garbage
        return collect
    except (ImportError, AttributeError):
        return functools.partial(gc.collect, 0)



@dataclasses.dataclass(frozen=True)
class _Probe:
    """What this JAX does with a host array on one platform (measured once
    per process and platform: _probe)."""

    #: jax._src's batched_device_put makes what jax.device_put makes.
    fast: bool
    #: A read-only, 64-byte aligned float32 array becomes a jax.Array on its memory.
    aliases: bool
    #: ... and that jax.Array keeps the array's root alive.
    keeps_alive: bool


_probes: dict[str, _Probe] = {}
_probe_lock = threading.Lock()


def _probe(jax: Any, device: Any) -> _Probe:
    with _probe_lock:
        found = _probes.get(device.platform)
        if found is None:
            found = _probes[device.platform] = _measure(jax, device)
            if not found.fast:
                warnings.warn(
                    f"to_jax: JAX {jax.__version__} has no batched_device_put as shmpipe knows it; each array "
                    "goes through jax.device_put (about 40 µs more per array, on the trainer's thread)",
                    ShmpipeWarning,
                    stacklevel=5,  # the caller of to_jax()
                )
        return found


def _measure(jax: Any, device: Any) -> _Probe:
    root = (np.arange(ALIGNMENT + 256) % 251).astype(np.uint8)
    start = (-root.ctypes.data) % ALIGNMENT
    arr = root[start : start + 256].view(np.float32)
    arr.flags.writeable = False
    expected = arr.copy()
    public = jax.device_put(arr, device)
    fast = False
    try:
        from jax._src import core
        from jax._src.lib import xla_client

        made = xla_client.batched_device_put(
            core.shaped_abstractify(arr), jax.sharding.SingleDeviceSharding(device), [arr], [device], True
        )
        fast = (
            type(made) is type(public)
            and made.aval == public.aval
            and made.sharding == public.sharding
            and made.committed == public.committed
            and np.array_equal(np.asarray(made), expected)
        )
    except Exception:  # gone, renamed, or another signature: the public call will do
        made = None
    out = made if fast else public
    aliases = device.platform == "cpu" and _on_memory_of(out, arr)
    # Whether `out` keeps the root alive, told without a full collection
    # (one of the whole process, 50 ms and more once JAX is imported, in the
    # first batch's time). jaxlib lets go of the host arrays it no longer
    # needs at its own collection only, so it runs after each step below:
    # after our references (and the other array's, `made` or `public`,
    # which may hold the root too) are gone; then if the root is alive, and
    # gone once `out` is, `out` held it. If it outlives that too, something
    # else holds it (a cycle, a cache of JAX's) and we cannot tell: "no",
    # the safe answer (put() then holds each leaf itself).
    root_ref = weakref.ref(root)
    del root, arr, made, public
    collector()()
    outlived_us = root_ref() is not None
    del out
    collector()()
    keeps_alive = outlived_us and root_ref() is None
    return _Probe(fast, aliases, keeps_alive)


def _on_memory_of(out: Any, arr: np.ndarray) -> bool:
    """Whether every shard of jax.Array `out` lies in `arr`'s memory."""
    lo = arr.ctypes.data
    hi = lo + arr.nbytes
    try:
        return all(lo <= s.data.unsafe_buffer_pointer() < hi or arr.nbytes == 0 for s in out.addressable_shards)
    except Exception:  # a buffer without a host pointer (an accelerator's)
        return False


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one shape and dtype of leaf goes to the target: what
    jax.device_put works out for it, worked out once."""

    aval: Any
    devices: list[Any]
    #: each device's slice of the leaf (None: the whole leaf, each device)
    indices: list[Any] | None
    #: The integer dtype JAX keeps a 64-bit one as (jax_enable_x64 off),
    #: into whose range each batch's values must fit: JAX would wrap them
    #: (2**40 + 1 came out 1). None where nothing is narrowed.
    narrowed: np.dtype[Any] | None = None
    bounds: tuple[int, int] = (0, 0)


class Target:
    """Where the leaves go (a device, or a sharding's devices) and the
    call that puts one there."""

    def __init__(self, jax: Any, sharding: Any, device: Any) -> None:
        self.jax = jax
        if sharding is not None and device is not None:
            raise ShmpipeValueError(
                "to_jax: pass sharding= or device=, not both (a sharding names its devices; for one device, "
                "jax.sharding.SingleDeviceSharding(device))"
            )
        if sharding is not None:
            if not isinstance(sharding, jax.sharding.Sharding):
                raise ShmpipeTypeError(
                    f"to_jax(sharding=...) takes a jax.sharding.Sharding (NamedSharding(mesh, P('data'))), "
                    f"not {type(sharding).__name__}"
                )
            self.sharding = sharding
            self.committed = True
        else:
            found = _checked_device(jax, device)
            if found is None:
                # JAX's default placement (jax.default_device, the config):
                # uncommitted, as jax.device_put(x) and jnp.asarray(x) make.
                self.sharding = jax.device_put(np.zeros((), np.float32)).sharding
                self.committed = False
            else:
                self.sharding = jax.sharding.SingleDeviceSharding(found)
                self.committed = True
        devices = sorted(self.sharding.addressable_devices, key=lambda d: d.id)
        if not devices:
            raise ShmpipeValueError(f"to_jax: the sharding {self.sharding} has no device in this process")
        self.on_host = all(d.platform == "cpu" for d in devices)
        #: Several processes: each leaf is this process's share of a global array.
        self.global_ = not self.sharding.is_fully_addressable
        #: The pipeline's batches may differ in size (from_dataset's partial last batch).
        self.sizes_vary = False
        #: ... and the rows of an epoch's short batch, where the pipeline knows them (its arrays' first axis)
        self.short_batch: int | None = None
        #: The first batch's rows (the first axis of its first array leaf): the batch size
        self.first_rows: int | None = None
        probe = _probe(jax, devices[0])
        self.fast = probe.fast and not self.global_
        #: JAX aliases host arrays here but would not keep them alive: we do.
        self.hold = self.on_host and probe.aliases and not probe.keeps_alive
        self.plans: dict[tuple[tuple[int, ...], np.dtype[Any]], _Plan] = {}
        #: JAX's 64-bit mode when the plans were made (follow_x64)
        self.x64 = bool(jax.config.jax_enable_x64)
        if self.fast:
            from jax._src import core
            from jax._src.lib import xla_client

            self._abstractify: Callable[[np.ndarray], Any] = core.shaped_abstractify
            self._batched_put: Callable[..., Any] = xla_client.batched_device_put

    def follow_x64(self) -> None:
        """Forgets the plans if JAX's 64-bit mode changed since they were
        made: a plan's aval, and what a 64-bit leaf becomes, depend on it.
        Read per batch (about 0.2 us) in the thread that puts it, as JAX
        reads it there: the config's mode (``jax.config.update``) reaches
        the thread of the ahead path; a ``with jax.enable_x64():`` of the
        trainer's thread, JAX's thread-local mode, does not (docs/jax.md)."""
        x64 = bool(self.jax.config.jax_enable_x64)
        if x64 != self.x64:
            self.plans.clear()
            self.x64 = x64

    def put(self, leaf: Any) -> Any:
        """`leaf` as a jax.Array on the target, if it is an array or a
        NumPy scalar; otherwise `leaf` itself. Unplanned for an array of a
        shape and dtype without a plan yet (plan_and_put makes it)."""
        if type(leaf) is not np.ndarray:
            if not isinstance(leaf, (np.ndarray, np.generic)):
                return leaf
            leaf = np.asarray(leaf)  # a NumPy scalar: a fresh 0-d array of it
        plan = self.plans.get((leaf.shape, leaf.dtype))
        if plan is None or (plan.narrowed is not None and not _fits(leaf, plan.bounds)):
            raise Unplanned  # (one that does not fit: refused by plan_and_put, which names it)
        return self._put(leaf, plan, "batch")

    def plan_and_put(self, leaf: Any, path: str) -> Any:
        """put(), making the plan of a new shape and dtype (its checks
        name the leaf by `path`)."""
        if type(leaf) is not np.ndarray:
            if not isinstance(leaf, (np.ndarray, np.generic)):
                return leaf
            leaf = np.asarray(leaf)
        plan = self.plans.get((leaf.shape, leaf.dtype))
        if plan is None:
            plan = self._plan(leaf, path)
        if plan.narrowed is not None and not _fits(leaf, plan.bounds):
            raise ShmpipeValueError(
                f"{path}: its {leaf.dtype} values run from {leaf.min()} to {leaf.max()}, and JAX keeps {leaf.dtype} "
                f"as {plan.narrowed} without jax_enable_x64, which would wrap them: turn it on "
                '(jax.config.update("jax_enable_x64", True)), or make the values fit'
            )
        return self._put(leaf, plan, path)

    def _put(self, leaf: np.ndarray, plan: _Plan, path: str) -> Any:
        if self.fast:
            shards = [leaf] * len(plan.devices) if plan.indices is None else [leaf[i] for i in plan.indices]
            out = self._batched_put(plan.aval, self.sharding, shards, plan.devices, self.committed)
        elif self.global_:
            try:
                out = self.jax.make_array_from_process_local_data(self.sharding, leaf)
            except ValueError as exc:
                raise ShmpipeValueError(
                    f"{path}: JAX cannot make it this process's share of a global array of sharding "
                    f"{self.sharding} (shape {leaf.shape}): {exc}"
                ) from None
        else:
            out = self.jax.device_put(leaf, self.sharding if self.committed else None)
        if self.hold:
            weakref.finalize(out, _keep, leaf)
        return out

    def _plan(self, leaf: np.ndarray, path: str) -> _Plan:
        """Checks a new shape and dtype of leaf (the checks of the first
        batch, before the first step) and works out how it goes."""
        _check_dtype(self.jax, leaf.dtype, path)
        sharding = self.sharding
        splits = not sharding.is_fully_replicated
        if splits and leaf.ndim == 0:
            raise ShmpipeValueError(
                f"{path}: a 0-d array (a NumPy scalar) cannot be split along a first axis over the "
                f"{sharding.num_devices} devices of the sharding; make it one value per example (shape "
                "(batch,)), or a Python number, which stays as it is"
            )
        spec, ways = _ways(sharding)
        if ways is not None and len(ways) > leaf.ndim:  # (JAX raises for some; P("data", None) it took, and jit not)
            raise ShmpipeValueError(
                f"{path}: the sharding's {spec} names {len(ways)} axes, and this leaf has {leaf.ndim} "
                f"(shape {leaf.shape})"
            )
        if self.global_:
            # make_array_from_process_local_data works the global shape
            # out from each process's share; it checks the split itself.
            plan = _Plan(None, [], None)
        else:
            try:
                sharding.shard_shape(leaf.shape)
                index_map = sharding.addressable_devices_indices_map(leaf.shape)
            except (ValueError, IndexError, AssertionError) as exc:  # (JAX's, by kind of sharding and mistake)
                raise ShmpipeValueError(self._unsplit(leaf, path, ways, exc)) from None
            if self.short_batch is not None and leaf.ndim:  # refused now, not after the epoch's other batches
                try:
                    sharding.shard_shape((self.short_batch, *leaf.shape[1:]))
                except (ValueError, IndexError, AssertionError) as exc:
                    raise ShmpipeValueError(
                        f"{path}: the epoch's last batch will have {self.short_batch} rows (the dataset's length "
                        f"is not a multiple of batch_size), which the sharding cannot split evenly over its "
                        f"devices; pass drop_last=True ({exc})"
                    ) from None
            devices = list(index_map)
            whole = len(devices) == 1 or sharding.is_fully_replicated
            aval = self._abstractify(leaf) if self.fast else None
            plan = _Plan(aval, devices, None if whole else list(index_map.values()))
        kept = np.dtype(self.jax.dtypes.canonicalize_dtype(leaf.dtype))
        if leaf.dtype.kind in "iu" and kept.itemsize < leaf.dtype.itemsize:
            info = np.iinfo(kept)
            plan = dataclasses.replace(plan, narrowed=kept, bounds=(int(info.min), int(info.max)))
        self.plans[(leaf.shape, leaf.dtype)] = plan
        if self.first_rows is None and leaf.ndim:
            self.first_rows = leaf.shape[0]
        return plan

    def _unsplit(
        self, leaf: np.ndarray, path: str, ways: list[tuple[int, str]] | None, exc: BaseException
    ) -> str:
        """Why the sharding cannot split `leaf`: the axis it cannot split
        evenly, where its `ways` (_ways's, worked out by _plan) say which."""
        axis = next((k for k, (n, _) in enumerate(ways or ()) if leaf.shape[k] % n), None)
        if axis is None or axis > 0:  # another kind of sharding (JAX's words say which axis), or a later axis
            where = f"its axis {axis} has {leaf.shape[axis]} entries" if axis else f"its shape {leaf.shape}"
            along = f" ({ways[axis][0]} shards along it: mesh axes {ways[axis][1]})" if ways and axis else ""
            return f"{path}: {where}, which the sharding cannot split evenly{along} ({exc})"
        # The batch size is the first batch's rows: a later batch of other rows is a short one (helper 92:
        # a first batch of 6 rows was told to pass drop_last=True, which then failed the same way).
        later = self.first_rows is not None and leaf.shape[0] != self.first_rows
        fix = (
            "the batches differ in size: an epoch's last batch is short where the dataset's length is not "
            "a multiple of batch_size (pass drop_last=True), and a batch_sampler's are its own (make each "
            "a multiple of them)"
            if later and self.sizes_vary else "make the batch size a multiple of them"
        )
        assert ways is not None
        return (
            f"{path}: its first axis has {leaf.shape[0]} rows, which the sharding cannot split evenly over its "
            f"devices ({ways[0][0]} shards along it: mesh axes {ways[0][1]}); {fix} ({exc})"
        )


class Unplanned(Exception):
    """A leaf of a shape and dtype Target has no plan for yet."""


def _keep(_: Any) -> None:
    """weakref.finalize's callback: holding its argument until then was the point."""


def _ways(sharding: Any) -> tuple[str, list[tuple[int, str]] | None]:
    """A NamedSharding's spec, and per axis it names how many shards it
    splits that axis into, with the mesh axes (as words); (its repr, None)
    for another kind of sharding."""
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is None or mesh is None:
        return repr(sharding), None
    ways = []
    for entry in spec:
        names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        if not all(name in mesh.shape for name in names):  # (P.UNCONSTRAINED, and what JAX adds later)
            return repr(spec), None
        ways.append((math.prod(mesh.shape[name] for name in names), ", ".join(map(repr, names))))
    return repr(spec), ways


def _fits(leaf: np.ndarray, bounds: tuple[int, int]) -> bool:
    """Whether integer `leaf`'s values lie within `bounds` (its smallest and largest)."""
    return not leaf.size or bool(bounds[0] <= leaf.min() and leaf.max() <= bounds[1])


_dtype_ok: dict[np.dtype[Any], bool] = {}


def _check_dtype(jax: Any, dtype: np.dtype[Any], path: str) -> None:
    """BatchTypeError naming `path` for a dtype JAX cannot hold (strings,
    objects, datetimes, records): what jax.device_put accepts, asked once
    per dtype on an empty array."""
    ok = _dtype_ok.get(dtype)
    if ok is None:
        try:
            jax.device_put(np.empty(0, dtype), jax.local_devices(backend="cpu")[0])
            ok = True
        except (TypeError, ValueError):
            ok = False
        _dtype_ok[dtype] = ok
    if not ok and dtype.kind in "biufc" and not dtype.isnative:
        raise BatchTypeError(
            f"JAX takes numbers in this machine's byte order only, and {dtype!r} is the other "
            "(arr.astype(arr.dtype.newbyteorder('=')) in the dataset turns it)",
            path,
        )
    if not ok:
        raise BatchTypeError(f"JAX has no dtype for {dtype!r} (only numbers and bools)", path)


def _checked_device(jax: Any, device: Any) -> Any:
    """The jax.Device `device` names (a Device, "cpu", "gpu", "tpu",
    "cuda:1"), refused now if there is none (rather than at the first
    batch, which would then be lost)."""
    if device is None or isinstance(device, jax.Device):
        return device
    if not isinstance(device, str):
        raise ShmpipeTypeError(f"to_jax(device=...) takes a jax.Device or a name like 'gpu:0', not {device!r}")
    platform, _, index = device.partition(":")
    try:
        local = jax.local_devices(backend=platform)
        why = ""
    except (RuntimeError, ValueError) as exc:  # no such backend: JAX says which it has
        local, why = [], f": {exc}"
    number = int(index) if index.isascii() and index.isdigit() else None if index else 0
    if number is not None and number < len(local):
        return local[number]
    if local and number is None:
        why = f": {index!r} is not a device number"
    elif local:
        why = f": it has {len(local)} {platform} device{'s' if len(local) > 1 else ''} here, numbered from 0"
    raise ShmpipeValueError(
        f"to_jax(device={device!r}): JAX {jax.__version__} has no such device here "
        f"(its devices: {', '.join(str(d) for d in jax.local_devices())}){why}"
    )


def warn_about_copies(host: Any, out: Any) -> None:
    """After a first batch on the host: a warning for each large leaf that
    JAX copied, with why (the module doc)."""
    put = dict(leaves_with_paths(out))
    for path, leaf in leaves_with_paths(host):
        if type(leaf) is not np.ndarray or leaf.nbytes < COPY_WARN_BYTES:
            continue
        result = put[path]
        if _on_memory_of(result, leaf):
            continue
        if result.dtype != leaf.dtype:
            why = f"JAX keeps {leaf.dtype} as {result.dtype} (jax_enable_x64 is off)"
        elif leaf.ctypes.data % ALIGNMENT:
            why = f"it is not {ALIGNMENT}-byte aligned"
        elif not leaf.flags.c_contiguous:
            why = "it is not C-contiguous"
        else:
            why = "the sharding's slices of it are not 64-byte aligned, or JAX would not alias it"
        warnings.warn(
            f"to_jax copies {path} ({leaf.nbytes:,} bytes) for each batch: {why}; see docs/jax.md",
            ShmpipeWarning,
            stacklevel=4,
        )
