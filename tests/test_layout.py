"""Which way the imports go (docs/design.md, "Where things live").

Read from the source, not by importing it: function-level imports count,
and so do imports only for type checkers (under ``if TYPE_CHECKING:``): a
circle closed by a type-only import is still a knot a reader must untie.
"""

import ast
import copy
import functools
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "shmpipe"

#: The generic core: it knows the transport contract and nothing below it.
CORE = [
    "_api",
    "_stream",
    "_frameworks",
    "_pipeline",
    "_group",
    "_group._options",
    "_group._wire",
    "_group._door",
    "_group._leader",
    "_group._rank",
    "_launch",
    "_worker",
    "_counters",
    "_stats",
    "_options",
    "transport",
    "registry",
    "_batch",
]
#: The ring engine, and the transports (all of them, the default too).
ENGINE = {"shmpipe._ring", "shmpipe._codec", "shmpipe._segments"}
#: What the compiled engine may import of the package: the leaves below
#: everything. The ring: the errors, the outcomes of a take, the codec it
#: cimports. The codec: the errors and the batch contract's own leaves
#: (checking a batch, ArraySpec, walking a tree).
ENGINE_MAY_IMPORT = {
    "shmpipe._ring": {"shmpipe.errors", "shmpipe._outcomes", "shmpipe._codec"},
    "shmpipe._codec": {"shmpipe.errors", "shmpipe._batch", "shmpipe._spec", "shmpipe._tree"},
}

_CIMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+)?c?import\s+([\w., ]+)", re.M)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*")) if p.suffix in (".py", ".pyx")}


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that importing `name` runs, if any."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _from_import(base: str, names: list[str], modules: dict[str, Path]) -> set[str]:
    """``from base import names``: the submodules named, and base itself
    for names that are not modules. (Importing a submodule runs its parent
    package's __init__ first, but that is already running or done whenever
    a circle could close: only edges to what is named count here.)"""
    subs = {f"{base}.{n}" for n in names if f"{base}.{n}" in modules}
    return subs | ({base} if len(subs) < len(names) else set())


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    text = path.read_text()
    found: set[str] = set()
    if path.suffix == ".pyx":  # Cython: read the import lines themselves
        for source, names in _CIMPORT.findall(text):
            if source:
                found.update(_from_import(source, [n.strip() for n in names.split(",") if n.strip()], modules))
            else:
                found.update(n.strip().split(" ")[0] for n in names.split(","))
    else:
        tree = ast.parse(text)
        package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                found.update(_from_import(base, [alias.name for alias in node.names], modules))
    return {t for t in (_target(name, modules) for name in found if name.startswith("shmpipe")) if t}


@functools.cache
def _read_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _graph() -> dict[str, set[str]]:
    """Who imports whom: the sources are read and parsed once per test run
    (about 0.5 s), each test gets its own copy."""
    return copy.deepcopy(_read_graph())


def test_the_reader_of_imports_sees_what_is_there():
    graph = _graph()
    assert "shmpipe.transports.shm" in graph and "shmpipe._ring" in graph
    assert "shmpipe._ring" in graph["shmpipe.transports.shm"]
    assert "shmpipe._codec" in graph["shmpipe._ring"]  # a cimport
    assert "shmpipe._launch" in graph["shmpipe._pipeline"]
    assert "shmpipe._tf" in graph["shmpipe._frameworks"]  # a function-level import counts
    assert "shmpipe._torch" in graph["shmpipe._frameworks"]  # ... and one under TYPE_CHECKING too
    assert "shmpipe._group._leader" in graph["shmpipe._group._rank"]  # inside the group package


def test_the_engine_imports_nothing_above_it():
    graph = _graph()
    for engine, allowed in ENGINE_MAY_IMPORT.items():
        above = graph[engine] - allowed
        assert not above, f"{engine} imports {sorted(above)}"
    for leaf in ("shmpipe.errors", "shmpipe._outcomes", "shmpipe._tree"):
        assert graph[leaf] <= {"shmpipe._tree"}, f"{leaf} is no leaf: it imports {sorted(graph[leaf])}"


def test_streams_are_made_above_both_shapes():
    graph = _graph()
    # The pipeline knows nothing of groups; the API knows both; only the
    # package's face imports the API.
    assert not any(m.startswith("shmpipe._group") for m in graph["shmpipe._pipeline"])
    assert {"shmpipe._pipeline", "shmpipe._group"} <= graph["shmpipe._api"]
    assert [m for m, deps in graph.items() if "shmpipe._api" in deps] == ["shmpipe"]
    # The adapters know the base of every stream, never a shape of one.
    for adapter in ("shmpipe._torch", "shmpipe._tf", "shmpipe._jax"):
        assert "shmpipe._stream" in graph[adapter]
        assert not graph[adapter] & {"shmpipe._pipeline", "shmpipe._group", "shmpipe._group._rank"}


@pytest.mark.parametrize("core", CORE)
def test_the_core_knows_only_the_contract(core):
    graph = _graph()
    forbidden = {m for m in graph[f"shmpipe.{core}"] if m in ENGINE or m.startswith("shmpipe.transports")}
    assert not forbidden, f"shmpipe.{core} imports {sorted(forbidden)}"


def test_no_import_circles():
    graph = _graph()
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


#: Statements that open a block (an ``elif`` continues its ``if``'s block).
_BLOCKS = (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.AsyncFor, ast.AsyncWith, ast.Match)
MAX_NESTING = 4


def _nesting(node: ast.AST, depth: int = 0) -> int:
    deepest = depth
    elif_ = node.orelse[0] if isinstance(node, ast.If) and len(node.orelse) == 1 else None
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue  # measured on its own
        opens = isinstance(child, _BLOCKS) and not (child is elif_ and isinstance(child, ast.If))
        deepest = max(deepest, _nesting(child, depth + opens))
    return deepest


@pytest.mark.parametrize("core", CORE)
def test_the_core_nests_no_block_deeper_than_four(core):
    modules = _modules()
    path = modules[f"shmpipe.{core}"]
    deep = [
        f"{node.name} ({_nesting(node)})"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _nesting(node) > MAX_NESTING
    ]
    assert not deep, f"shmpipe.{core}: {', '.join(deep)} nest blocks more than {MAX_NESTING} deep"


def test_the_nesting_reader_counts_blocks_not_elifs():
    def measure(src: str) -> int:
        (fn,) = ast.parse(src).body
        return _nesting(fn)

    assert measure("def f():\n    if a:\n        pass\n    elif b:\n        pass\n    elif c:\n        pass\n") == 1
    assert measure("def f():\n    while a:\n        with b:\n            for c in d:\n                pass\n") == 3
