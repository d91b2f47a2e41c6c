"""shmpipe: batches from parallel producer processes to a trainer, through a
shared-memory ring, without copies or pickle.

    import shmpipe

    def make_batches():
        info = shmpipe.get_worker_info()
        for i in range(100):
            yield {"image": ..., "label": ...}

    with shmpipe.from_iterators([make_batches] * 4) as pipe:
        for batch in pipe:
            train_step(batch)
    print(pipe.stats())

A map-style dataset (``__len__`` and ``__getitem__``, a torch Dataset)
goes to ``shmpipe.from_dataset(dataset, batch_size=..., shuffle=True,
num_workers=4)``, with the DataLoader's arguments; every pipeline has
``state_dict()`` and ``load_state_dict()`` to resume a run.

Importing shmpipe imports only the package: each name below loads its
module at its first use (no Ray, Arrow or TensorFlow unless a transport or a
bridge of theirs is used), so that shmpipe's own producer processes load
what a producer runs on and not the trainer's side.
"""

import gc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names below are, for type checkers and IDEs
    from shmpipe._api import from_dataset, from_iterators
    from shmpipe._group import RankPipeline
    from shmpipe._pipeline import Pipeline
    from shmpipe._producer_context import WorkerInfo, get_worker_info, reserve
    from shmpipe._spec import ArraySpec
    from shmpipe._stats import GroupStats, PipelineStats
    from shmpipe.errors import (
        BatchTooLargeError,
        BatchTypeError,
        CorruptChannelError,
        DescriptorLimitError,
        GroupError,
        GroupLaunchError,
        GroupStartError,
        PipelineClosedError,
        PipelineTimeoutError,
        RankDiedError,
        SegmentExistsError,
        SharedMemoryFullError,
        ShmpipeError,
        ShmpipeTypeError,
        ShmpipeValueError,
        ShmpipeWarning,
        TransportUnavailableError,
        WorkerDiedError,
        WorkerError,
    )
    from shmpipe.registry import available_transports, get_transport, register_transport

__version__ = "0.1.0"

#: Where each public name lives. A name's module is imported when the name is
#: first used (PEP 562), not by ``import shmpipe``: shmpipe's fork server and
#: its producers import ``shmpipe._worker`` and the transport they use, and
#: with eager imports here every one of them loaded the trainer's side too
#: (the pipeline, groups, options, the registry and importlib.metadata):
#: the server's imports took 0.29 s against 0.21 s without them (medians of
#: 6, 2 cores), and a first pipeline waits for them.
_WHERE = {
    **dict.fromkeys(("from_dataset", "from_iterators"), "shmpipe._api"),
    "RankPipeline": "shmpipe._group",
    "Pipeline": "shmpipe._pipeline",
    **dict.fromkeys(("WorkerInfo", "get_worker_info", "reserve"), "shmpipe._producer_context"),
    "ArraySpec": "shmpipe._spec",
    **dict.fromkeys(("GroupStats", "PipelineStats"), "shmpipe._stats"),
    **dict.fromkeys(
        (
            "BatchTooLargeError",
            "BatchTypeError",
            "CorruptChannelError",
            "DescriptorLimitError",
            "GroupError",
            "GroupLaunchError",
            "GroupStartError",
            "PipelineClosedError",
            "PipelineTimeoutError",
            "RankDiedError",
            "SegmentExistsError",
            "SharedMemoryFullError",
            "ShmpipeError",
            "ShmpipeTypeError",
            "ShmpipeValueError",
            "ShmpipeWarning",
            "TransportUnavailableError",
            "WorkerDiedError",
            "WorkerError",
        ),
        "shmpipe.errors",
    ),
    **dict.fromkeys(("available_transports", "get_transport", "register_transport"), "shmpipe.registry"),
}

__all__ = [
    "ArraySpec",
    "BatchTooLargeError",
    "BatchTypeError",
    "CorruptChannelError",
    "DescriptorLimitError",
    "GroupError",
    "GroupLaunchError",
    "GroupStartError",
    "GroupStats",
    "Pipeline",
    "PipelineClosedError",
    "PipelineStats",
    "PipelineTimeoutError",
    "RankDiedError",
    "RankPipeline",
    "SegmentExistsError",
    "SharedMemoryFullError",
    "ShmpipeError",
    "ShmpipeTypeError",
    "ShmpipeValueError",
    "ShmpipeWarning",
    "TransportUnavailableError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerInfo",
    "available_transports",
    "clean",
    "from_dataset",
    "from_iterators",
    "get_transport",
    "get_worker_info",
    "prestart",
    "register_transport",
    "reserve",
    "signature_of",
]


def __getattr__(name: str) -> Any:
    """A public name, its module imported at its first use (and the name kept
    here, so this runs once per name); or a deprecated name (shmpipe.errors
    says which), with a DeprecationWarning."""
    if name in _COMPILED:
        return _compiled(name)
    module = _WHERE.get(name)
    if module is None:
        from shmpipe.errors import deprecated

        return deprecated(name, __name__)
    # The first use of a name imports its module, and with it much else
    # (shmpipe.from_iterators: the whole pipeline's side, importlib.metadata,
    # pathlib, ipaddress, ...), inside the user's own try/except of Ctrl-C.
    # A KeyboardInterrupt raised in the middle of an import can come out as
    # another exception (a RuntimeError, where it lands in a class body's
    # __set_name__, as in ipaddress) and leaves that import undone: held
    # back, it is raised here once the import is complete.
    # And without a garbage collection: an import makes long-lived objects
    # (modules, classes, functions), 7,000 of them for from_dataset's, which
    # count towards the next collection as any allocation does. In a process
    # that has just imported torch that was a full one, 60-90 ms spent
    # scanning torch's objects and freeing nothing of the import's, inside a
    # fresh process's first batch. Put off, the process pays it at its own
    # next allocations, as it would have without shmpipe. (Mercurial's
    # util.nogc does the same for the same reason. Not atomic with another
    # thread's gc.disable() meanwhile, which this enable undoes.)
    collecting = gc.isenabled()
    try:
        gc.disable()  # (inside: an exception raised here by a signal's handler still enables it again)
        import importlib

        from shmpipe._interrupts import ctrl_c_held_back

        with ctrl_c_held_back():
            value = getattr(importlib.import_module(module), name)
    finally:
        if collecting:
            gc.enable()
    globals()[name] = value
    return value


#: The modules the install compiles (setup.py): the ring, the codec, the spans, the tallies.
_COMPILED = ("_codec", "_ring", "_spans", "_tally")


def _compiled(name: str) -> Any:
    """``from shmpipe import _ring``, as the package's modules import the
    compiled core. Python asks this module for the name before it imports
    the submodule (so it is imported here), and where the import fails it
    would only say "cannot import name '_ring'": the usual cause is a
    clone's source tree, without the built extension, found before the
    installed package (Python puts the script's folder, or the current one
    with ``-c``, first on sys.path). Says so, and what to do."""
    import importlib
    import os

    full = f"{__name__}.{name}"
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError as exc:
        if exc.name != full:
            raise
        here = os.path.dirname(os.path.abspath(__file__))
        if os.path.exists(os.path.join(here, name + ".pyx")):
            why = (
                f"this shmpipe is a source tree ({here}), found on sys.path before the installed package "
                "(Python puts the script's folder, or the current one, first): run Python from another "
                "folder, or build the extension in this tree with `pip install -e .`"
            )
        else:
            why = f"this installation ({here}) lacks it: reinstall shmpipe (pip install --force-reinstall shmpipe)"
        raise ImportError(f"shmpipe's compiled core, {full}, is not built: {why}", name=full) from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def clean(dry_run: bool = False) -> list[str]:
    """Removes this user's shmpipe segments whose owning process has died
    (never one whose owner lives). Returns the names removed (or, with
    dry_run, that would be)."""
    from shmpipe._segments import sweep  # the ring engine loads when it is used

    return sweep(dry_run=dry_run)


def prestart(*objects: Any) -> None:
    """Starts shmpipe's fork server now, in the background, so that the
    first pipeline of this process finds it running.

    Producers (start method ``"forkserver"``, the default) are forked from a
    server process that the first pipeline starts and waits for: a fresh
    interpreter that imports NumPy and shmpipe's producer side, 0.15 to 0.3 s
    of that pipeline's first batch. Called early, at the top of a training
    script before ``import torch`` or ``import tensorflow``, it starts the
    server, which imports while the script goes on, and imports here what a
    first pipeline imports in this process (NumPy, the default transport,
    ``numpy.random``), then it returns: about 0.07 s where NumPy was
    imported before, 0.14 s where it was not (a quiet 2-core machine, a
    fresh process), which a first pipeline would otherwise pay. The gain is
    the server's start overlapping the script's imports: where those keep
    every core busy (``import tensorflow`` on 2 cores), the script's first
    batch comes no sooner (``shmpipe bench feed``'s start-up recipes time it
    from the script's first line). Starts no server where one runs already,
    or the platform has no forkserver.
    Optional: without it the first pipeline starts the server.

    The server imports what ``objects`` are made of too (the dataset, or the
    sources, that the pipelines will get: their modules and those their code
    imports), as the first pipeline would for its own sources, so that its
    producers inherit those modules instead of each importing them. A
    pipeline cannot add to a running server: what its sources need beyond
    it, each of its producers imports itself, or, where that brings a heavy
    framework (a dataset whose module imports torch at its top), a second
    server started for it imports once. So where the dataset comes from such
    a module, pass it, once it is made: ``shmpipe.prestart(dataset)``."""
    from shmpipe._interrupts import ctrl_c_held_back

    # Whole even where a Ctrl-C comes meanwhile (__getattr__ says why): the
    # server's start, the imports of a first pipeline in this process
    # (numpy.random among them), and the pipeline's side of shmpipe, which a
    # first pipeline would import (the names here load their modules at
    # their first use).
    with ctrl_c_held_back():
        from shmpipe._launch import prestart as _prestart

        _prestart(objects)
        import shmpipe._api  # noqa: F401


def signature_of(*batches: Any) -> Any:
    """A tf.data ``output_signature`` for batches like these: their
    structure, dtypes and shapes, with None for each dimension that differs
    between them (imports TensorFlow)."""
    from shmpipe._frameworks import require_framework

    require_framework("tensorflow", "shmpipe.signature_of()")
    from shmpipe._tf import signature_of as _signature_of

    return _signature_of(*batches)
