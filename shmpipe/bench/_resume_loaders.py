"""bench resume's loaders: how each makes a fresh epoch of the JPEG dataset,
takes a checkpoint after k batches, and resumes from it (shmpipe, shmpipe
with fork, torchdata's StatefulDataLoader, Grain, torch's DataLoader).

It imports nothing of shmpipe, torch or Grain at its top: a new process of
shmpipe/bench/_resume_fresh.py loads this file as a module of its own
(not as shmpipe.bench._resume_loaders, which would import the package)
before its clock starts, so that all of shmpipe it runs -- ``import
shmpipe`` too -- is inside the clock. shmpipe is imported where a pipeline
is made; the peers' modules are imported by whoever measures, before the
clock (``imports``).
"""

from __future__ import annotations

import abc
import copy
import importlib
import importlib.util
import json
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from shmpipe.bench._jpegs import JpegFolder
    from shmpipe.bench._resume_config import ResumeConfig

__all__ = ["LOADERS", "Loader", "Opened", "grain_flags_parsed"]


@dataclass
class Opened:
    """A loader being iterated: its batches, and how to stop it."""

    batches: Iterator[Any]
    close: Callable[[], None]
    loader: Any = None


class Loader(abc.ABC):
    """One way of loading the dataset: a fresh epoch, a checkpoint after k
    of its batches, a new loader resumed from that checkpoint."""

    name: ClassVar[str]
    resumes_by: ClassVar[str]
    #: (module, what to install) the loader needs beside torch-free shmpipe
    needs: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: what it imports, in order (imported before the clock: by resume's
    #: _one_time in this process, by a new process before it measures)
    imports: ClassVar[tuple[str, ...]] = ()
    #: whose version the report gives
    version_of: ClassVar[str | None] = None

    def why_not(self) -> str | None:
        for module, how in (("PIL", "pip install pillow"), *self.needs):
            if importlib.util.find_spec(module) is None:
                return f"not installed: {module} ({how})"
        return None

    def version(self) -> str | None:
        if self.version_of is None:
            import shmpipe

            return shmpipe.__version__
        try:
            from importlib.metadata import version

            return version(self.version_of)
        except Exception:  # noqa: BLE001 - a version is only informative
            return None

    @abc.abstractmethod
    def fresh(self, ds: JpegFolder, cfg: ResumeConfig) -> Opened: ...

    @abc.abstractmethod
    def checkpoint(self, opened: Opened, k: int) -> Any:
        """The loader's checkpoint after k batches were handed out."""

    @abc.abstractmethod
    def resume(self, ds: JpegFolder, cfg: ResumeConfig, state: Any) -> Opened:
        """A new loader whose next batch is the first after the checkpoint."""


class _Shmpipe(Loader):
    name = "shmpipe"
    resumes_by = "position: load_state_dict() on a new pipeline"

    def __init__(self, start_method: str | None = None, name: str | None = None) -> None:
        self.start_method = start_method
        if name is not None:
            self.name = name  # type: ignore[misc]  # a variant's row

    def _pipe(self, ds: JpegFolder, cfg: ResumeConfig) -> Any:
        import shmpipe  # here, not at the top: see the module's docstring

        return shmpipe.from_dataset(
            ds, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.workers, seed=cfg.seed,
            timeout=cfg.timeout_s, start_method=self.start_method,
        )

    def fresh(self, ds: JpegFolder, cfg: ResumeConfig) -> Opened:
        pipe = self._pipe(ds, cfg)
        return Opened(iter(pipe), pipe.close, pipe)

    def checkpoint(self, opened: Opened, k: int) -> Any:
        # Through JSON, as a checkpoint file gives it back.
        return json.loads(json.dumps(opened.loader.state_dict()))

    def resume(self, ds: JpegFolder, cfg: ResumeConfig, state: Any) -> Opened:
        pipe = self._pipe(ds, cfg)
        try:
            pipe.load_state_dict(state)
        except BaseException:
            pipe.close()
            raise
        return Opened(iter(pipe), pipe.close, pipe)


def _peer(module: str) -> Any:
    """A peer's module, imported by name: torchdata and Grain are optional
    and untyped, and a name mypy cannot follow is checked nowhere (an
    import statement would fail the type check where they are missing)."""
    return importlib.import_module(module)


def _torch_generator(seed: int) -> Any:
    import torch

    return torch.Generator().manual_seed(seed)


def _close_torch(it: Any) -> Callable[[], None]:
    def close() -> None:
        # The multi-worker iterator stops its workers when collected; this
        # stops them now, so the next loader's timing does not share the
        # cores with them. (_shutdown_workers is private, but it is what
        # the iterator's __del__ calls.)
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    return close


class _DataLoader(Loader):
    name = "DataLoader"
    resumes_by = "none: a new loader fast-forwards, iterating and discarding the batches before the position"
    needs = (("torch", 'pip install "shmpipe[torch]"'),)
    imports = ("torch", "torch.utils.data")
    version_of = "torch"

    def _loader(self, ds: JpegFolder, cfg: ResumeConfig) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(
            ds, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.workers,
            generator=_torch_generator(cfg.seed), timeout=cfg.timeout_s,
        )

    def fresh(self, ds: JpegFolder, cfg: ResumeConfig) -> Opened:
        it = iter(self._loader(ds, cfg))
        return Opened(it, _close_torch(it))

    def checkpoint(self, opened: Opened, k: int) -> Any:
        return k  # all a plain DataLoader can go back to: how many batches to skip

    def resume(self, ds: JpegFolder, cfg: ResumeConfig, state: Any) -> Opened:
        it = iter(self._loader(ds, cfg))
        try:
            for _ in range(int(state)):
                next(it)
        except BaseException:
            _close_torch(it)()
            raise
        return Opened(it, _close_torch(it))


class _StatefulDataLoader(Loader):
    name = "StatefulDataLoader"
    resumes_by = "its load_state_dict() on a new loader (the sampler fast-forwarded)"
    needs = (("torch", 'pip install "shmpipe[torch]"'), ("torchdata", "pip install torchdata"))
    imports = ("torch", "torch.utils.data", "torchdata.stateful_dataloader")
    version_of = "torchdata"

    def _loader(self, ds: JpegFolder, cfg: ResumeConfig) -> Any:
        StatefulDataLoader = _peer("torchdata.stateful_dataloader").StatefulDataLoader
        with warnings.catch_warnings():
            # torchdata 0.11 calls torch.set_vital, which torch 2.13 says is
            # deprecated, on every loader: the peer's noise, not this run's.
            warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)
            return StatefulDataLoader(
                ds, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.workers,
                generator=_torch_generator(cfg.seed), timeout=cfg.timeout_s,
            )

    def fresh(self, ds: JpegFolder, cfg: ResumeConfig) -> Opened:
        loader = self._loader(ds, cfg)
        it = iter(loader)
        return Opened(it, _close_torch(it), loader)

    def checkpoint(self, opened: Opened, k: int) -> Any:
        return copy.deepcopy(opened.loader.state_dict())

    def resume(self, ds: JpegFolder, cfg: ResumeConfig, state: Any) -> Opened:
        loader = self._loader(ds, cfg)
        loader.load_state_dict(state)
        it = iter(loader)
        return Opened(it, _close_torch(it), loader)


def grain_flags_parsed() -> None:
    """With JAX installed, Grain 0.2.18's iterator reads one of its absl
    flags, and absl raises UnparsedFlagAccessError in a program that never
    parsed its flags (only absl.app.run does). A bench process has no absl
    flags of its own: they are marked parsed."""
    flags = _peer("absl.flags").FLAGS
    if not flags.is_parsed():
        flags.mark_as_parsed()


class _Grain(Loader):
    name = "Grain"
    resumes_by = "its checkpoint: get_state() / set_state() on a new loader's iterator"
    needs = (("grain", "pip install grain"),)
    imports = ("grain.python",)
    version_of = "grain"

    def _loader(self, ds: JpegFolder, cfg: ResumeConfig) -> Any:
        grain = _peer("grain.python")
        grain_flags_parsed()
        sampler = grain.IndexSampler(
            len(ds), shard_options=grain.NoSharding(), shuffle=True, num_epochs=1, seed=cfg.seed
        )
        return grain.DataLoader(
            data_source=ds, sampler=sampler, operations=[grain.Batch(cfg.batch_size, drop_remainder=False)],
            worker_count=cfg.workers,
        )

    @staticmethod
    def _close(it: Any) -> Callable[[], None]:
        def close() -> None:
            # Grain 0.2's DataLoaderIterator has no close(); the dataset
            # iterator it wraps does (it stops the worker processes).
            inner = getattr(it, "_iterator", None)
            if inner is not None and hasattr(inner, "close"):
                inner.close()

        return close

    def fresh(self, ds: JpegFolder, cfg: ResumeConfig) -> Opened:
        it = iter(self._loader(ds, cfg))
        return Opened(it, self._close(it))

    def checkpoint(self, opened: Opened, k: int) -> Any:
        return opened.batches.get_state()  # type: ignore[attr-defined]  # Grain's iterator

    def resume(self, ds: JpegFolder, cfg: ResumeConfig, state: Any) -> Opened:
        it = iter(self._loader(ds, cfg))
        try:
            it.set_state(state)
        except BaseException:
            self._close(it)()
            raise
        return Opened(it, self._close(it))


#: Loader name -> its implementation (the order is the table's).
LOADERS: dict[str, Loader] = {
    loader.name: loader
    for loader in (
        _Shmpipe(),
        # The same, its producers forked from this process as the
        # DataLoaders' workers are (shmpipe's default start method is
        # forkserver): how much of its first batch is the producers' start.
        _Shmpipe("fork", "shmpipe (fork)"),
        _StatefulDataLoader(),
        _Grain(),
        _DataLoader(),
    )
}
