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

The fork server's process, and the two ways a producer's process is
started without the script (forked from it, or spawned), are
_forkserver's; this module decides which each producer gets, ships its
source, and chooses what the server imports beforehand.
"""

from __future__ import annotations

import dis
import functools
import importlib.util
import multiprocessing
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.context import BaseContext
from typing import Any, NamedTuple

from shmpipe import _byvalue, _forkserver, _starts
from shmpipe.errors import ShmpipeWarning, users_stacklevel

__all__ = [
    "HEAVY_FRAMEWORKS",
    "Plan",
    "Shipments",
    "Shipped",
    "default_start_method",
    "plan",
    "start_server",
    "unpack",
]


def default_start_method() -> str:
    """forkserver where the platform has it (producers start from a clean
    server process, not a copy of a trainer's threads), else spawn."""
    methods = multiprocessing.get_all_start_methods()
    return "forkserver" if "forkserver" in methods else "spawn"


#: Frameworks whose import costs a producer seconds and hundreds of MiB:
#: named in the warning when a producer has to import the script.
HEAVY_FRAMEWORKS = ("tensorflow", "torch", "jax", "keras", "ray")


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


class Plan(NamedTuple):
    """How each producer of a pipeline starts.

    (A NamedTuple, which a fresh process defines in a fifth of a frozen
    dataclass's time: docs/design.md, "A fresh pipeline's first batches".)
    """

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
    # The script's producers start as multiprocessing's would (its own fork
    # server, or spawn), through _starts' classes (a peer that dies in
    # its start is an error there, never a SIGPIPE or a wait for ever).
    with_script: Callable[..., Any] = (
        _starts.ScriptServerProcess if method == "forkserver" else _starts.ScriptSpawnProcess
    )
    if type(transport).__module__ in _byvalue.MAIN_NAMES:
        why = f"the transport {type(transport).__qualname__} is a class of the script"
        return Plan([with_script] * n, list(sources), [why] * n)
    clean: Callable[..., Any] = _forkserver.ServerProcess if method == "forkserver" else _starts.SpawnProcess
    if method == "forkserver":
        _preload_with_the_server(sources, type(transport).__module__)
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
            out.process_types.append(with_script)
            out.sources.append(source)
            out.imports_script.append(item)
    _warn_if_heavy(out.imports_script, sources)
    return out


def bound_only_under_the_guard(obj: Any, script: str) -> str | None:
    """The name by which `obj` (a function or class of the script, an
    instance of such a class, or a method bound to one) is found in the
    script, or a global its code reads, where the script binds that name
    under ``if __name__ == "__main__":`` and nowhere else: a producer that
    imports the script (as __mp_main__) does not run that block, and would
    not find it (an AttributeError or a NameError in each producer, then a
    death). None where every such name is bound outside the guard, or not
    seen bound at all (exec, a global statement, type(), a builtin: left to
    pickling, or to the producer, to say), or the script cannot be read."""
    names = [(getattr(obj, "__qualname__", None) or type(obj).__qualname__).split(".")[0]]
    owner = getattr(obj, "__self__", None)  # a bound method pickles its instance, and so its class
    if owner is not None and getattr(type(owner), "__module__", None) in _byvalue.MAIN_NAMES:
        names.append(type(owner).__qualname__.split(".")[0])
    # And the globals the code it runs reads, which the producer looks up
    # in the script it imported.
    runs = getattr(obj, "__func__", obj)
    if not isinstance(runs, types.FunctionType):
        runs = type(obj).__dict__.get("__call__")  # an instance's own class's __call__
    if isinstance(runs, types.FunctionType) and runs.__module__ in _byvalue.MAIN_NAMES:
        names.extend(sorted(_byvalue.global_names(runs.__code__)))
    bindings = _script_bindings(script)
    if bindings is None:
        return None
    on_import, under_guard = bindings
    return next((name for name in names if name in under_guard and name not in on_import), None)


def _script_bindings(script: str) -> tuple[frozenset[str], frozenset[str]] | None:
    """The names `script` binds at its top level when imported, and those
    it binds in the bodies of its ``if __name__ == "__main__":`` blocks
    (not looking into function or class bodies; a comprehension's names
    count, which only makes bound_only_under_the_guard refuse less). None
    where it cannot be read. Cached by the file's size and time."""
    try:
        st = os.stat(script)
    except OSError:
        return None
    return _bindings_of(script, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _bindings_of(script: str, size: int, mtime_ns: int) -> tuple[frozenset[str], frozenset[str]] | None:
    import ast  # here: only a source that needs the script gets this far

    try:
        with open(script, "rb") as f:
            tree = ast.parse(f.read(), script)
    except (OSError, SyntaxError, ValueError):
        return None

    def main_guard(test: ast.expr) -> bool:
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
            return False
        sides = [test.left, *test.comparators]
        return any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and any(
            isinstance(x, ast.Constant) and x.value == "__main__" for x in sides
        )

    found: tuple[set[str], set[str]] = (set(), set())  # on import, under a guard
    todo: list[tuple[ast.AST, int]] = [(node, 0) for node in tree.body]
    while todo:
        node, guarded = todo.pop()
        if isinstance(node, ast.If) and main_guard(node.test):
            todo.extend((child, 1) for child in node.body)
            todo.extend((child, guarded) for child in node.orelse)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[guarded].add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found[guarded].update(alias.asname or alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found[guarded].add(node.id)
        else:
            todo.extend((child, guarded) for child in ast.iter_child_nodes(node))
    return frozenset(found[0]), frozenset(found[1])


def start_server(objects: Sequence[Any]) -> bool:
    """Starts the fork server now (shmpipe.prestart, through
    _launch.prestart, which holds Ctrl-C back around it), preloading what
    `objects` are made of as it would a first pipeline's sources; its
    imports then run on their own. False (nothing done) where it runs
    already or the platform has no fork server."""
    if _forkserver.server_pid() is not None or "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    _preload_with_the_server(objects)
    _forkserver.launch_server()
    return True


def _preload_with_the_server(sources: Sequence[Any], transport_module: str | None = None) -> None:
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
    hundreds of MiB each).

    The module of one of shmpipe's transports too, which each producer
    unpickles its transport from (the arrow transport's imports pyarrow: 27
    ms of CPU a producer, measured), unless it brings a heavy framework. Not
    a user's transport: its module may keep state per process (a client, a
    pid), which producers would then share (helper 54)."""
    modules = _modules_of(sources)
    # One look at each module, at each depth, for this pipeline: a source
    # that uses NumPy brings its hundred submodules, each of whose globals
    # name the others (75 ms a pipeline where a running server had to be
    # asked, looking again at each one each time, measured).
    heavy_frameworks_of = functools.partial(_heavy_frameworks_of, seen={})
    # (The default transport's is preloaded always: no look at its globals, 3 ms of a fresh first batch.)
    if (
        transport_module is not None and transport_module.startswith("shmpipe.transports.")
        and transport_module not in _forkserver.SERVER_PRELOAD
    ):
        if getattr(sys.modules.get(transport_module), "__file__", None) and not heavy_frameworks_of(transport_module):
            modules.add(transport_module)
    _forkserver.preload(modules, heavy_frameworks_of)


def _heavy_frameworks_of(name: str, depth: int = 2, seen: dict[tuple[str, int], set[str]] | None = None) -> set[str]:
    """The heavy frameworks (HEAVY_FRAMEWORKS) that module `name`, loaded in
    this process, is or has at its top: among its globals a module, class,
    function or object of one (`import torch`, `from torch import zeros`,
    `DEVICE = torch.device("cpu")`), or a module that has one at its top
    (`import torchvision`: `depth` levels of modules). `seen`: what earlier
    calls found, by module and depth, to be looked up instead of looked at
    again (the same modules' globals, read moments apart)."""
    top = name.split(".")[0]
    if top in HEAVY_FRAMEWORKS:
        return {top}
    module = sys.modules.get(name)
    if module is None or depth == 0:
        return set()
    if seen is not None and (name, depth) in seen:
        return seen[name, depth]
    found: set[str] = set()
    for value in list(vars(module).values()):
        if isinstance(value, types.ModuleType):
            found |= _heavy_frameworks_of(value.__name__, depth - 1, seen)
            continue
        named = isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType))
        for origin in (_module_of(value) if named else None, type(value).__module__):
            if isinstance(origin, str) and origin.split(".")[0] in HEAVY_FRAMEWORKS:
                found.add(origin.split(".")[0])
    if seen is not None:
        seen[name, depth] = found
    return found


def _modules_of(sources: Sequence[Any]) -> set[str]:
    """The modules that `sources` are made of, loaded in this process and
    imported by name in a producer (_preload_with_the_server)."""
    names: set[object] = set()  # module names, and None where an object has none
    loaded = list(sys.modules)
    for source in {id(s): s for s in sources}.values():  # from_dataset's [source] * num_workers: once
        for obj in (source, *_attributes(source)):
            names.update((getattr(obj, "__module__", None), type(obj).__module__))
            for imported in _imported_by_code(obj):
                # with the submodules of it that the trainer has loaded, as a
                # fork would have them (Pillow loads its JPEG plugin at the
                # first open: 15 ms more); of shmpipe's own, not its private
                # modules: a producer's are the server's already (SERVER_PRELOAD),
                # and the rest are the pipeline's side, which no producer runs
                # (a generator of the script that calls shmpipe.get_worker_info()
                # made the server import all of them: its pipeline's first batch
                # 0.333 s against 0.313 s without them, medians of 12, measured)
                if imported is not None:
                    names.update(m for m in loaded if (m == imported or m.startswith(imported + "."))
                                 and not _pipelines_side(m))
    modules: set[str] = set()
    for name in names:
        if isinstance(name, str) and name not in _byvalue.MAIN_NAMES and name != "builtins":
            module = sys.modules.get(name)
            if module is not None and getattr(module, "__file__", None):
                modules.add(name)
    return modules


def _pipelines_side(name: str) -> bool:
    """Whether module `name` is one of shmpipe's private modules or its
    registry: what a producer needs of them the fork server imports
    anyway (SERVER_PRELOAD), and the rest only a pipeline runs."""
    return name.startswith("shmpipe._") or name == "shmpipe.registry"


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


_IMPORT_NAME = dis.opmap["IMPORT_NAME"]


def _imports_of(code: types.CodeType, package: str) -> set[str]:
    """What the import statements of `code` itself name: `import a.b` is
    a.b, `from a import b` is a and a.b (b may be a module), a relative
    import is resolved against `package`."""
    names: set[str] = set()
    if _IMPORT_NAME not in code.co_code[::2]:
        # No import statement: most methods. (Each instruction's opcode is
        # at an even offset, its argument and inline caches' at the others
        # and in the CACHE units, opcode 0.) Disassembling every method of a
        # dataset's class and its bases was most of a fresh pipeline's
        # look at its sources.
        return names
    consts: list[Any] = []  # the constants loaded last: an import's level and names
    imported: str | None = None
    for ins in dis.get_instructions(code):
        if ins.opname == "EXTENDED_ARG":
            continue  # the next instruction's argument's high bits (a code of 256 names or more)
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
        stacklevel=users_stacklevel(),
    )
