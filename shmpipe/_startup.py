"""How producer processes start: without the trainer's script where they can.

multiprocessing's forkserver and spawn children import the script that
started them (``__main__``, again, as ``__mp_main__``) before they unpickle
their target, because a function of the script is pickled by its name
there. A training script imports TensorFlow or torch at its top, and each
producer paid for it: 9.5 s to the first batch and 1.1 GiB of producers'
memory with 4 producers, for sources that use NumPy.

Here a producer imports what its source needs and nothing of the script:

- with forkserver (the default), producers are forked from shmpipe's own
  fork server: a process started once per trainer, on the first pipeline
  (again where a later one needs a heavy framework that it lacks), that has
  imported shmpipe's producer side (NumPy, the shm transport) and never the
  script. A producer is a fork of it: milliseconds, and the
  pages it imported are shared by every producer;
- with spawn, each producer is a fresh interpreter that is not told to
  import the script;
- the source travels as bytes (Shipped): what the script defines in it --
  its function or class, and the globals they use -- by value (_byvalue),
  the rest by reference, and producer_main loads it.

Where a source cannot travel without the script (it uses a module-level
lock, an open file, an enum of the script ...: _byvalue.NotByValue says
which) or the transport is a class of the script, that producer starts as
before, with multiprocessing's own context: it imports the script, with
all its imports, and a script without a main guard gets the error that
says to add one (_launch._refuse_while_bootstrapping). A ShmpipeWarning
says so when the script has a heavy framework loaded. start_method='fork'
is untouched: a fork of the trainer needs nothing shipped.

The preparation data that a stdlib child reads before its target is the
standard one less the two entries that name the script
(init_main_from_path, init_main_from_name); the two _launch methods below
are CPython 3.11's with only that changed (and our server), and the server
is an instance of the standard library's ForkServer of our own, so its
children read their arguments through the standard code
(forkserver.main, spawn._main).
"""

from __future__ import annotations

import array
import dis
import fcntl
import importlib.util
import io
import multiprocessing
import os
import select
import socket
import sys
import termios
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from multiprocessing import forkserver, popen_forkserver, popen_spawn_posix, reduction, spawn, util
from multiprocessing.context import BaseContext, set_spawning_popen
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

from shmpipe import _byvalue
from shmpipe.errors import ShmpipeError, ShmpipeWarning

__all__ = [
    "HEAVY_FRAMEWORKS",
    "SERVER_PRELOAD",
    "Plan",
    "Shipments",
    "Shipped",
    "default_start_method",
    "plan",
    "start_server",
    "server_pid",
    "unpack",
]


def default_start_method() -> str:
    """forkserver where the platform has it (producers start from a clean
    server process, not a copy of a trainer's threads), else spawn."""
    methods = multiprocessing.get_all_start_methods()
    return "forkserver" if "forkserver" in methods else "spawn"


#: What the fork server imports before it forks producers: what every
#: producer needs to unpickle its arguments and run (the default transport
#: included, and numpy.random, which every producer seeds before each pass:
#: 20-40 ms of each producer's first batch where it imported it itself; and
#: the wrappers of a source, _sources, which a producer unpickles), so that a
#: producer inherits it instead of importing it. The pipeline's side
#: (_api, _pipeline, _group, _options, the registry) is not here: a producer
#: never runs it (tests/test_package.py checks that this list loads none of it).
SERVER_PRELOAD = ["shmpipe._worker", "shmpipe._startup", "shmpipe._sources", "shmpipe.transports.shm", "numpy.random"]

#: Frameworks whose import costs a producer seconds and hundreds of MiB:
#: named in the warning when a producer has to import the script.
HEAVY_FRAMEWORKS = ("tensorflow", "torch", "jax", "keras", "ray")

#: How long a start that found the fork server gone (a connection refused,
#: or closed before it answered) waits for its process to end before it
#: starts a new one; one that is still running then is an error.
SERVER_END_WAIT_S = 2.0

#: The fork server's command line (Python 3.11, _ForkServer): the trainer's
#: sys.path first, then the preload, then the standard library's server
#: (given no preload of its own). NumPy's OpenBLAS starts its threads as it is
#: imported, and each spins on a core for 2**28 cycles (about 0.1 s) before
#: it sleeps, taking it from the trainer and the server itself while the
#: first pipeline waits for the server: on 2 cores, the server's preload
#: took 283 ms (281 ms of CPU) with the spin, 225 ms (217 ms) without
#: (median of 15). So the preload runs with OPENBLAS_THREAD_TIMEOUT=4 (2**4
#: cycles), unless the trainer's environment sets it; it is removed before
#: the server forks anyone, so the producers' environment is the
#: trainer's (their BLAS threads sleep sooner when idle: a wake-up of
#: microseconds per call).
_SERVER_COMMAND = """\
import os, sys
sys.path[:] = %r
quiet = "OPENBLAS_THREAD_TIMEOUT" not in os.environ
if quiet:
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = "4"
for name in %r:
    try:
        __import__(name)
    except ImportError:
        pass
if quiet:
    del os.environ["OPENBLAS_THREAD_TIMEOUT"]
from multiprocessing.forkserver import main
main(%d, %d, [], **%r)
"""


class _ForkServer(forkserver.ForkServer):
    """The standard library's fork server, whose process imports its preload
    with the trainer's sys.path.

    CPython 3.11's forkserver.main is given the trainer's sys.path but does
    not apply it before the preload: the server, started as ``python -c``,
    has the trainer's *current directory* first on its path, and a trainer
    run from a source checkout of shmpipe (its compiled modules not built
    there: CI runs the tests from one) made the server import that shmpipe,
    which cannot load; every producer then failed to start. Later versions
    apply it (and 3.13 adds an authentication key this copy would lack), so
    the override is for versions before 3.12 only: ensure_running as in
    3.11, with the command line setting sys.path first (_SERVER_COMMAND).
    """

    def ensure_running(self) -> None:
        if sys.version_info >= (3, 12):
            super().ensure_running()
            return
        from multiprocessing import connection, resource_tracker

        with self._lock:  # type: ignore[attr-defined]
            resource_tracker.ensure_running()
            if self._forkserver_pid is not None:  # type: ignore[has-type]
                pid, _ = os.waitpid(self._forkserver_pid, os.WNOHANG)  # type: ignore[has-type]
                if not pid:
                    return  # still alive
                self._forget()
            data = {k: v for k, v in spawn.get_preparation_data("ignore").items() if k in ("main_path", "sys_path")}
            with socket.socket(socket.AF_UNIX) as listener:
                address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
                listener.bind(address)
                if not util.is_abstract_socket_namespace(address):
                    os.chmod(address, 0o600)
                listener.listen()
                # Every client holds the write end of the "alive" pipe: the
                # server ends when the read end says they all have.
                alive_r, alive_w = os.pipe()
                try:
                    fds_to_pass = [listener.fileno(), alive_r]
                    line = _SERVER_COMMAND % (
                        data.get("sys_path", sys.path),
                        self._preload_modules,  # type: ignore[attr-defined]
                        listener.fileno(),
                        alive_r,
                        data,
                    )
                    exe = spawn.get_executable()
                    args = [exe, *util._args_from_interpreter_flags(), "-c", line]  # type: ignore[attr-defined]
                    pid = util.spawnv_passfds(exe, args, fds_to_pass)  # type: ignore[arg-type]
                except BaseException:
                    os.close(alive_w)
                    raise
                finally:
                    os.close(alive_r)
                self._forkserver_address = address
                self._forkserver_alive_fd = alive_w
                self._forkserver_pid = pid

    def forget_if_ended(self, pid: int | None, wait_s: float) -> bool:
        """Whether the server's process `pid` has ended, waited for up to
        `wait_s` (a process killed a moment ago may still be exiting: not
        yet a zombie, so ensure_running took it for running); an ended one
        is forgotten, as ensure_running forgets one it finds dead, and the
        next start starts a new server."""
        deadline = time.monotonic() + wait_s
        with self._lock:  # type: ignore[attr-defined]
            if pid is None or self._forkserver_pid != pid:
                return True  # forgotten already (another thread's start may have started its successor)
            while True:
                try:
                    ended, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere: gone all the same
                    ended = pid
                if ended:
                    break
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.005)
            self._forget()
            return True

    def _forget(self) -> None:
        """Lets go of a server whose process ended (under self._lock): the
        next ensure_running starts a new one."""
        alive = self._forkserver_alive_fd
        if alive is not None:
            os.close(alive)
        self._forkserver_address = None
        self._forkserver_alive_fd = None  # type: ignore[assignment]
        self._forkserver_pid = None  # type: ignore[assignment]


#: The fork server that new producers fork from. A later pipeline whose
#: sources need a heavy framework that it lacks replaces it by a server that
#: has it (_preload_with_the_server); the one replaced keeps running, in
#: _RETIRED, for the producers it forked: their exit codes come through it.
#: Each ends with this process (its end of a pipe closes): at most one per
#: framework of HEAVY_FRAMEWORKS, since each new one has all the old had.
_SERVER = _ForkServer()
_SERVER.set_forkserver_preload(SERVER_PRELOAD)
_RETIRED: list[_ForkServer] = []
#: Guards the choice and the swap of _SERVER: pipelines may be made from
#: several threads at once.
_SERVER_LOCK = threading.Lock()


class Shipped:
    """A source pickled in the consumer (_byvalue.dumps), loaded in the producer."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:
        return Shipped, (self.data,)

    def load(self) -> Callable[[], Iterable[Any]]:
        source: Callable[[], Iterable[Any]] = _byvalue.loads(self.data)
        return source


def unpack(source: Any) -> Callable[[], Iterable[Any]]:
    """In a producer: its source, loaded if it was shipped."""
    if isinstance(source, Shipped):
        return source.load()
    loaded: Callable[[], Iterable[Any]] = source
    return loaded


class Shipments:
    """Sources pickled for producers that do not import the script, each
    once: the options' check pickles every source to know whether it can
    travel so (ship), and the launcher ships what the check made
    (plan) instead of pickling it again (a dataset held in memory: 150-330
    ms for 80 MB, measured). Kept by identity, with the source itself, so
    a source replaced since (wrapped) is pickled anew, never mistaken for
    another; plan takes them out, so the pickles live on in the launcher's
    plan alone."""

    def __init__(self) -> None:
        self._made: dict[int, tuple[Any, Shipped | str]] = {}

    def ship(self, source: Any) -> Shipped | str:
        """`source` pickled (a Shipped), or why it cannot travel without the script."""
        made = self._made.get(id(source))
        if made is not None and made[0] is source:
            return made[1]
        try:
            result: Shipped | str = Shipped(_byvalue.dumps(source))
        except _byvalue.NotByValue as exc:
            result = str(exc)
        self._made[id(source)] = (source, result)
        return result

    def take(self, source: Any) -> Shipped | str:
        """ship(source), forgetting it here."""
        result = self.ship(source)
        del self._made[id(source)]
        return result


@dataclass
class Plan:
    """How each producer of a pipeline starts."""

    #: per producer: the Process class it starts with (multiprocessing's
    #: context's, typed Any as there, or one of ours)
    process_types: list[Callable[..., Any]]
    #: per producer: what goes as its source argument (a Shipped, or the
    #: source itself where it goes as before)
    sources: list[Any]
    #: per producer: why it imports the script (None: it does not)
    imports_script: list[str | None]


def plan(ctx: BaseContext, sources: Sequence[Any], transport: Any, shipments: Shipments | None = None) -> Plan:
    """How the producers of `sources` start under `ctx` (multiprocessing's
    context for the pipeline's start method); `shipments`: the sources the
    options' check pickled already."""
    method = ctx.get_start_method()
    n = len(sources)
    if method == "fork":
        return Plan([ctx.Process] * n, list(sources), [None] * n)  # type: ignore[attr-defined]
    if type(transport).__module__ in _byvalue.MAIN_NAMES:
        why = f"the transport {type(transport).__qualname__} is a class of the script"
        return Plan([ctx.Process] * n, list(sources), [why] * n)  # type: ignore[attr-defined]
    clean: Callable[..., Any] = _ServerProcess if method == "forkserver" else _SpawnProcess
    if method == "forkserver":
        _preload_with_the_server(sources)
    shipments = shipments or Shipments()
    shipped: dict[int, Shipped | str] = {}  # by id: [make_batches] * 16 is pickled once
    out = Plan([], [], [])
    for source in sources:
        if id(source) not in shipped:
            shipped[id(source)] = shipments.take(source)
        item = shipped[id(source)]
        if isinstance(item, Shipped):
            out.process_types.append(clean)
            out.sources.append(item)
            out.imports_script.append(None)
        else:
            out.process_types.append(ctx.Process)  # type: ignore[attr-defined]
            out.sources.append(source)
            out.imports_script.append(item)
    _warn_if_heavy(out.imports_script, sources)
    return out


def start_server(objects: Sequence[Any]) -> bool:
    """Starts the fork server now (shmpipe.prestart, through
    _launch.prestart, which holds Ctrl-C back around it), preloading what
    `objects` are made of as it would a first pipeline's sources; its
    imports then run on their own. False (nothing done) where it runs
    already or the platform has no fork server."""
    import multiprocessing

    if server_pid() is not None or "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    _preload_with_the_server(objects)
    launch_server()
    return True


def launch_server() -> None:
    """Starts the fork server's process now, with the preload plan() set,
    where it is not running: the caller then does other work while it boots
    (0.2-0.3 s); the first producer's start connects to it, waiting for
    the rest of its boot. (ensure_running does nothing where it runs.)"""
    _SERVER.ensure_running()


def _preload_with_the_server(sources: Sequence[Any]) -> None:
    """Before the fork server's first start: it imports the modules the
    sources are made of too (their classes', functions' and attributes'
    modules, one level deep, and the modules their code imports as it runs,
    where the trainer has them imported and they are not the script), so
    each producer inherits them instead of importing them before its first
    batch (a dataset's module: 10-20 ms a producer; Pillow, which a dataset
    of images imports in its __getitem__: 30 ms, measured).

    A server already running cannot import more. Its producers import what
    it lacks themselves, each, unless that brings a heavy framework (a
    dataset's module with `import torch` at its top, after shmpipe.prestart()
    started the server before it): then a new server imports it once, for
    this pipeline and the next ones, rather than every producer (seconds and
    hundreds of MiB each)."""
    global _SERVER
    modules = _modules_of(sources)
    with _SERVER_LOCK:
        preload: list[str] = _SERVER._preload_modules  # type: ignore[attr-defined]
        missing = sorted(modules - set(preload))
        if server_pid() is None:
            # Not started yet (the first pipeline's, or one swapped in that no
            # producer used yet): it imports these too, with what it had.
            _SERVER.set_forkserver_preload([*preload, *missing])
            return
        needed = set().union(*map(_heavy_frameworks_of, missing))
        if not needed or needed <= set().union(*map(_heavy_frameworks_of, preload)):
            return  # nothing heavy, or nothing its producers would not inherit
        server = _ForkServer()
        server.set_forkserver_preload([*preload, *missing])
        _RETIRED.append(_SERVER)
        _SERVER = server  # started by the first producer forked from it


def _heavy_frameworks_of(name: str, depth: int = 2) -> set[str]:
    """The heavy frameworks (HEAVY_FRAMEWORKS) that module `name`, loaded in
    this process, is or has at its top: among its globals a module, class,
    function or object of one (`import torch`, `from torch import zeros`,
    `DEVICE = torch.device("cpu")`), or a module that has one at its top
    (`import torchvision`: `depth` levels of modules)."""
    top = name.split(".")[0]
    if top in HEAVY_FRAMEWORKS:
        return {top}
    module = sys.modules.get(name)
    if module is None or depth == 0:
        return set()
    found: set[str] = set()
    for value in list(vars(module).values()):
        if isinstance(value, types.ModuleType):
            found |= _heavy_frameworks_of(value.__name__, depth - 1)
            continue
        named = isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType))
        for origin in (_module_of(value) if named else None, type(value).__module__):
            if isinstance(origin, str) and origin.split(".")[0] in HEAVY_FRAMEWORKS:
                found.add(origin.split(".")[0])
    return found


def _modules_of(sources: Sequence[Any]) -> set[str]:
    """The modules that `sources` are made of, loaded in this process and
    imported by name in a producer (_preload_with_the_server)."""
    names: set[object] = set()  # module names, and None where an object has none
    for source in sources:
        for obj in (source, *_attributes(source)):
            names.update((getattr(obj, "__module__", None), type(obj).__module__))
            for imported in _imported_by_code(obj):
                # with the submodules of it that the trainer has loaded, as a
                # fork would have them (Pillow loads its JPEG plugin at the
                # first open: 15 ms more)
                if imported is not None:
                    names.update(m for m in list(sys.modules) if m == imported or m.startswith(imported + "."))
    modules: set[str] = set()
    for name in names:
        if isinstance(name, str) and name not in _byvalue.MAIN_NAMES and name != "builtins":
            module = sys.modules.get(name)
            if module is not None and getattr(module, "__file__", None):
                modules.add(name)
    return modules


def _imported_by_code(obj: Any) -> set[str | None]:
    """The modules that the code of `obj` (a function; else the methods of
    its class and of that class's bases) imports when it runs: an import
    inside a function, which importing its module does not make. And for
    a function of the script (which travels by value: its module is not
    imported in the producer), the modules of the globals its code uses
    (`np`, a class imported from a module)."""
    functions: list[types.FunctionType] = []
    if isinstance(obj, types.FunctionType):
        functions.append(obj)
    else:
        for cls in (obj if isinstance(obj, type) else type(obj)).__mro__:
            if cls.__module__ == "builtins":
                continue
            for value in vars(cls).values():
                if isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                elif isinstance(value, property):
                    value = value.fget
                if isinstance(value, types.FunctionType):
                    functions.append(value)
    names: set[str | None] = set()
    for fn in functions:
        if fn.__module__ in _byvalue.MAIN_NAMES:
            for name in _byvalue.global_names(fn.__code__):
                names.add(_module_of(fn.__globals__.get(name)))
        module = sys.modules.get(fn.__module__)
        package = getattr(module, "__package__", None) or ""
        codes = [fn.__code__]
        while codes:
            code = codes.pop()
            codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
            names.update(_imports_of(code, package))
    return names


def _module_of(value: Any) -> str | None:
    """The module that `value` is (a module) or comes from, by name; None
    where it says none."""
    if isinstance(value, types.ModuleType):
        return value.__name__
    try:
        name = getattr(value, "__module__", None)
    except Exception:  # noqa: BLE001 - an object that raises on a look is no module's
        return None
    return name if isinstance(name, str) else None


def _imports_of(code: types.CodeType, package: str) -> set[str]:
    """What the import statements of `code` itself name: `import a.b` is
    a.b, `from a import b` is a and a.b (b may be a module), a relative
    import is resolved against `package`."""
    names: set[str] = set()
    consts: list[Any] = []  # the constants loaded last: an import's level and names
    imported: str | None = None
    for ins in dis.get_instructions(code):
        if ins.opname == "IMPORT_NAME":
            level = consts[-2] if len(consts) >= 2 and isinstance(consts[-2], int) else 0
            try:
                imported = importlib.util.resolve_name("." * level + ins.argval, package) if level else ins.argval
            except ImportError:  # a relative import beyond the top-level package
                imported = None
            if imported:
                names.add(imported)
        elif ins.opname == "IMPORT_FROM" and imported:
            names.add(f"{imported}.{ins.argval}")
        consts = [*consts[-1:], ins.argval] if ins.opname == "LOAD_CONST" else []
    return names


def _attributes(obj: Any) -> list[Any]:
    try:
        return list(vars(obj).values())
    except TypeError:  # no __dict__: its slots
        return [getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)]


def _warn_if_heavy(imports_script: list[str | None], sources: Sequence[Any]) -> None:
    heavy = [name for name in HEAVY_FRAMEWORKS if name in sys.modules]
    first = next((i for i, why in enumerate(imports_script) if why is not None), None)
    if first is None or not heavy:
        return
    count = sum(why is not None for why in imports_script)
    warnings.warn(
        f"{count} producer(s) import the training script, and with it {', '.join(heavy)}, because source "
        f"{first} ({sources[first]!r}) cannot travel without it: {imports_script[first]}. Each such producer "
        "pays the script's imports (seconds, hundreds of MiB). Define what the source uses inside it, or in "
        "a module of its own that does not import the framework.",
        ShmpipeWarning,
        stacklevel=_first_caller_outside_shmpipe(),
    )


def _first_caller_outside_shmpipe() -> int:
    """warnings.warn's stacklevel, in its caller, of the first frame that is
    not shmpipe's: the user's line that made the pipeline, however many of
    shmpipe's calls lie between."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).split(".")[0] == "shmpipe":
        frame = frame.f_back
        level += 1
    return level


def server_pid() -> int | None:
    """The fork server's pid, once started (for tests and the doctor)."""
    return _SERVER._forkserver_pid


def _preparation_data(name: str) -> dict[str, Any]:
    """multiprocessing's preparation data for a child, less the script."""
    data: dict[str, Any] = spawn.get_preparation_data(name)
    data.pop("init_main_from_path", None)
    data.pop("init_main_from_name", None)
    return data


def _pickled_for_child(popen: Any, process_obj: BaseProcess) -> io.BytesIO:
    """What a child reads first, pickled as multiprocessing pickles it: the
    preparation data (less the script), then the process object, with
    `popen` taking the descriptors that travel along."""
    buf = io.BytesIO()
    set_spawning_popen(popen)
    try:
        reduction.dump(_preparation_data(process_obj.name), buf)
        reduction.dump(process_obj, buf)
    finally:
        set_spawning_popen(None)
    return buf


class _ServerPopen(popen_forkserver.Popen):
    """A child of shmpipe's fork server (popen_forkserver.Popen._launch with
    the preparation data and the server changed)."""

    def _launch(self, process_obj: BaseProcess) -> None:
        buf = _pickled_for_child(self, process_obj)
        server, name = _SERVER, process_obj.name
        try:
            self._fork_from(server, buf, name)
            return
        except _ServerGone as gone:
            # The server ended after it was last seen running (killed: the
            # OOM killer's pick, say, while it was starting this child), and
            # no child of it has this start's data: a new server starts it.
            first = gone.pid
        try:
            self._fork_from(server, buf, name)
        except _ServerGone as gone:
            raise ShmpipeError(
                f"shmpipe's fork server (pid {first}) ended, and the one started in its place (pid {gone.pid}, "
                f"interpreter {spawn.get_executable()}) did not start {name} either: {gone.__cause__!r}"
            ) from gone.__cause__

    def _fork_from(self, server: _ForkServer, buf: io.BytesIO, name: str) -> None:
        """Has `server` fork child `name` and sends it `buf`; _ServerGone
        where the server ended (or refused) and no child of it can have the
        data, so that a new server may start it (see _server_gone)."""
        # The server this start talks to. (connect_to_new_process runs
        # ensure_running again, a no-op, and reads the address unlocked: a
        # successor started by another thread in between would be blamed
        # instead, a wrong message after a 2 s wait, never a second child.)
        server.ensure_running()
        used = server._forkserver_pid
        try:
            sentinel, w = server.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
        except (ConnectionError, FileNotFoundError) as exc:  # the request reached no server
            _server_gone(server, used, name, exc)
        finalizer = util.Finalize(self, util.close_fds, (sentinel,))  # type: ignore[attr-defined]
        try:
            # The data pipe's write end stays open until the server answers:
            # where it ends without answering, the pipe tells whether a child
            # may have read the data. (multiprocessing keeps a duplicate for
            # the child's parent_process(); a producer watches its consumer
            # itself, the owner's pidfd in _worker.py, so it is closed then:
            # one descriptor less per producer against `ulimit -n`.)
            written = 0  # what reached the pipe (a write past its 64 KiB waits for the child)
            try:
                with buf.getbuffer() as data:
                    while written < data.nbytes:
                        written += os.write(w, data[written:])
                pid = forkserver.read_signed(sentinel)
            except (BrokenPipeError, EOFError) as exc:
                _server_gone(server, used, name, exc, data_pipe=w, nbytes=written)
            finally:
                os.close(w)
        except BaseException:
            finalizer()  # the sentinel is closed now, not at a collection (its number may be reused by then)
            raise
        self.sentinel, self.finalizer, self.pid = sentinel, finalizer, pid


class _ServerGone(Exception):
    """The fork server `pid` ended, or refused, before it started a child,
    and no child of it can have that start's data: a new server may start
    it (_ServerPopen._launch)."""

    def __init__(self, pid: int | None) -> None:
        super().__init__(pid)
        self.pid = pid


def _server_gone(
    server: _ForkServer, pid: int | None, name: str, cause: BaseException, data_pipe: int | None = None,
    nbytes: int = 0,
) -> NoReturn:
    """A start of child `name` through `server`'s process `pid` failed with
    `cause`, a sign that it ended: _ServerGone once it has ended, where
    no child can have the start's data. A ShmpipeError where the process
    does not end, or where a child may have been forked and read the data
    (the server died between its fork and its answer): starting it again
    could make two producers of one."""
    if not server.forget_if_ended(pid, SERVER_END_WAIT_S):
        raise ShmpipeError(
            f"shmpipe's fork server (pid {pid}) did not start {name} ({cause!r}) and is still running after "
            f"{SERVER_END_WAIT_S} s"
        ) from cause
    if data_pipe is not None and not _unread_without_reader(data_pipe, nbytes):
        raise ShmpipeError(
            f"shmpipe's fork server (pid {pid}) ended while it started {name}, after it may have forked it "
            f"({cause!r}); not started again, which could make two of it"
        ) from cause
    raise _ServerGone(pid) from cause


def _unread_without_reader(fd: int, nbytes: int) -> bool:
    """Whether the pipe whose write end is `fd` has no reader left (POLLERR)
    and still holds all `nbytes` written to it: no process read any of the
    data, and none can."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)  # POLLERR is always reported
    events = poller.poll(200)  # the ended server's descriptors close as it exits: a moment
    if not any(ev & select.POLLERR for _, ev in events):
        return False
    left = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, left)
    return left[0] == nbytes


class _SpawnPopen(popen_spawn_posix.Popen):
    """A spawned child told nothing of the script (popen_spawn_posix.Popen._launch
    with the preparation data changed)."""

    def _launch(self, process_obj: BaseProcess) -> None:
        from multiprocessing import resource_tracker

        tracker_fd = resource_tracker.getfd()
        self._fds.append(tracker_fd)  # type: ignore[attr-defined]
        fp = _pickled_for_child(self, process_obj)

        parent_r = child_w = child_r = parent_w = None
        try:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            cmd = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            self._fds.extend([child_r, child_w])  # type: ignore[attr-defined]
            self.pid = util.spawnv_passfds(spawn.get_executable(), cmd, self._fds)  # type: ignore[arg-type,attr-defined]
            self.sentinel = parent_r
            # Closed once written, as for the fork server's producers.
            with open(parent_w, "wb", closefd=True) as f:
                parent_w = None
                f.write(fp.getbuffer())
        finally:
            if parent_w is not None:
                os.close(parent_w)
            fds_to_close = [parent_r] if parent_r is not None else []
            self.finalizer = util.Finalize(self, util.close_fds, fds_to_close)  # type: ignore[attr-defined]
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)


class _ServerProcess(BaseProcess):
    """A producer forked from shmpipe's fork server."""

    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj: BaseProcess) -> _ServerPopen:  # noqa: N802 (multiprocessing's name)
        return _ServerPopen(process_obj)


class _SpawnProcess(BaseProcess):
    """A producer spawned without the script."""

    _start_method = "spawn"

    @staticmethod
    def _Popen(process_obj: BaseProcess) -> _SpawnPopen:  # noqa: N802 (multiprocessing's name)
        return _SpawnPopen(process_obj)
