"""Pickles a source with what the trainer's script (``__main__``) defines in
it by value, so that a producer can run it without importing the script.

multiprocessing pickles a function or class by reference (its module and
name), and a producer started with spawn or forkserver then imports the
script again to find it (as ``__mp_main__``), with everything the script
imports at its top: TensorFlow or torch, seconds and hundreds of MiB per
producer, for a source that uses NumPy. Here a function or class whose
module is ``__main__`` travels as its code and the globals its code names
(read from its bytecode), each pickled in turn the same way; everything
else is pickled as multiprocessing pickles it (by reference where it is
importable). The globals travel with the trainer's values when the
pipeline starts (as a fork copies them), not values the script's top level
would compute again.

Restricted to what can be rebuilt faithfully: plain functions (closures,
defaults, lambdas and nested functions included), such a function under
``functools.cache`` or ``lru_cache`` (a new, empty cache in each producer,
as importing the script would make), and classes whose metaclass is
``type`` or ``abc.ABCMeta`` without ``__slots__``. Anything
else of ``__main__`` (an enum, a class with ``__slots__``, a module-level
lock or open file a source uses, an object pickled by a name in
``__main__``) makes dumps() raise NotByValue, and the caller starts that
producer the old way, importing the script (_startup).

Only the consumer pickles this way and only producers load it: the bytes
go from the trusted side to the other, never back. Code objects travel as
marshal data, which the same interpreter reads back (a producer runs the
trainer's own executable).
"""

from __future__ import annotations

import abc
import dis
import functools
import importlib
import io
import marshal
import pickle
import pickletools
import sys
import types
from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = ["MAIN_NAMES", "NotByValue", "dumps", "global_names", "loads"]

#: The names the script has as a module: __main__ in the trainer,
#: __mp_main__ where multiprocessing imported it again.
MAIN_NAMES = ("__main__", "__mp_main__")

#: Metaclasses whose classes are rebuilt as an empty class plus their
#: attributes (others run code at class creation that this does not redo).
_PLAIN_METACLASSES = (type, abc.ABCMeta)

#: A class's __dict__ entries that are not rebuilt from the pickle: made by
#: the class statement itself (__dict__, __weakref__, ABCMeta's cache) or
#: set apart (__module__).
_CLASS_SKIP = frozenset({"__dict__", "__weakref__", "__module__", "_abc_impl", "__abstractmethods__"})

#: What functools.cache and lru_cache return (a C type; pickled by default
#: by its name in its module, which for the script's is __main__).
_CACHE_WRAPPER = type(functools.cache(abs))
#: What lru_cache itself puts in a wrapper's __dict__, its own or copied
#: from the function (the rebuilt wrapper gets them again, and __module__
#: is "__main__"); the rest was set by the script and travels.
_CACHE_OWN = frozenset({"__wrapped__", "cache_parameters", *functools.WRAPPER_ASSIGNMENTS})

#: Opcodes that store into or read from the pickle's memo, and those that
#: push nothing (_main_reference follows what is on top of the stack).
_MEMO_PUTS = frozenset({"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"})
_MEMO_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_NO_PUSH = frozenset({"PROTO", "FRAME", "STOP"})

_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME"})


class NotByValue(Exception):
    """The object cannot travel without the script: the reason."""


def dumps(obj: Any) -> bytes:
    """`obj` pickled, what __main__ defines in it by value; NotByValue if
    a producer would still need the script to load it."""
    buf = io.BytesIO()
    try:
        _Pickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    except RecursionError:
        raise NotByValue("it nests too deeply to pickle") from None
    except Exception as exc:  # pickle raises what the objects raise: TypeError, PicklingError, ...
        raise NotByValue(str(exc) or type(exc).__name__) from None
    data = buf.getvalue()
    name = _main_reference(data)
    if name == "__main__":
        raise NotByValue("it names the script's module (__main__)")
    if name is not None:
        raise NotByValue(f"it refers to {name} in the script by name")
    return data


def loads(data: bytes) -> Any:
    """In a producer: what dumps() made (bytes from the consumer, trusted)."""
    return pickle.loads(data)


def _main_reference(data: bytes) -> str | None:
    """The first name in __main__ the pickle would look up ("__main__.x"),
    else "__main__" if any string in it starts with a name of the script's
    module (MAIN_NAMES: a global's value too, a false alarm that costs only
    the old, slower start), else None.

    STACK_GLOBAL takes the module's and the name's strings from the top of
    the stack, pushed just before it or fetched from the memo (a string
    pickled once is fetched so the next time): both are followed."""
    memo: dict[int, str | None] = {}
    pushed: list[str | None] = []  # the last two values pushed: a string, or None for anything else
    named = False
    for op, arg, _ in pickletools.genops(data):
        if isinstance(arg, str) and arg.split(" ", 1)[0] in MAIN_NAMES:
            named = True
            if op.name in ("GLOBAL", "INST"):  # their argument is "module name"
                return arg.replace(" ", ".")
        if op.name == "STACK_GLOBAL" and len(pushed) == 2 and pushed[0] in MAIN_NAMES:
            return f"{pushed[0]}.{pushed[1]}"
        if op.name in _MEMO_PUTS:  # MEMOIZE stores at the memo's length
            index = len(memo) if op.name == "MEMOIZE" else arg
            if isinstance(index, int):
                memo[index] = pushed[-1] if pushed else None
            continue
        if op.name in _NO_PUSH:
            continue
        if op.name in _MEMO_GETS:
            pushed.append(memo.get(arg) if isinstance(arg, int) else None)  # a GET's argument: the memo's index
        else:
            pushed.append(arg if isinstance(arg, str) and "UNICODE" in op.name else None)
        del pushed[:-2]
    return "__main__" if named else None


class _Pickler(ForkingPickler):
    """multiprocessing's pickler, with functions and classes of __main__
    pickled by value and modules by name."""

    def __init__(self, file: io.BytesIO, protocol: int) -> None:
        super().__init__(file, protocol)
        # One globals dict for every function of the script in this pickle,
        # as they shared one in the trainer (a `global` one writes, another reads).
        self._namespace = _Namespace()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.FunctionType) and obj.__module__ in MAIN_NAMES:
            return self._function(obj)
        if isinstance(obj, type) and obj.__module__ in MAIN_NAMES:
            return _class(obj)
        if isinstance(obj, _CACHE_WRAPPER) and getattr(obj.__wrapped__, "__module__", None) in MAIN_NAMES:
            # Rebuilt around the function (by value) with the same cache
            # parameters and an empty cache, and what the script set on the
            # wrapper (its __dict__, but for what lru_cache puts there). A
            # cached function that calls itself by its global name meets
            # the wrapper again while the wrapper's arguments are pickled:
            # pickle then keeps the one made inside and drops the outer,
            # so there is one wrapper, one cache.
            parameters = obj.cache_parameters()
            state = {k: v for k, v in obj.__dict__.items() if k not in _CACHE_OWN}
            return _make_cached, (obj.__wrapped__, parameters["maxsize"], parameters["typed"]), state
        if isinstance(obj, types.ModuleType):
            return _module(obj)
        if isinstance(obj, (staticmethod, classmethod)):  # in a class of the script
            return type(obj), (obj.__func__,)
        if isinstance(obj, property):
            return property, (obj.fget, obj.fset, obj.fdel, obj.__doc__)
        return NotImplemented

    def _function(self, fn: types.FunctionType) -> tuple[Any, ...]:
        names = global_names(fn.__code__)
        scope = fn.__globals__
        # Builtins are not copied: the producer's own resolve them.
        used = {name: scope[name] for name in sorted(names) if name in scope}
        cells = tuple(_cell_value(cell) for cell in fn.__closure__ or ())
        state = {
            "globals": used, "defaults": fn.__defaults__, "kwdefaults": fn.__kwdefaults__, "cells": cells,
            "dict": fn.__dict__, "qualname": fn.__qualname__, "doc": fn.__doc__,
        }
        # The state comes after the function is made (and memoized): a
        # function that names itself, or a method whose class names it,
        # finds the one being rebuilt.
        args = (self._namespace, marshal.dumps(fn.__code__), fn.__name__, len(cells))
        return _make_function, args, state, None, None, _set_function_state


class _Namespace:
    """Stands for the globals the script's functions share (made empty in
    the producer, filled by each function's state)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _new_namespace, ()


class _Empty:
    """The value of a closure cell not yet assigned (the class is the marker)."""


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _Empty


def global_names(code: types.CodeType) -> set[str]:
    """The global names `code` and the code nested in it read or write
    (LOAD_NAME: a class body nested in a function reads globals so)."""
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in _GLOBAL_OPS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return names


def _module(module: types.ModuleType) -> tuple[Any, ...]:
    name = module.__name__
    if name in MAIN_NAMES or sys.modules.get(name) is not module:
        raise pickle.PicklingError(f"module {name} cannot be imported by name in a producer")
    return importlib.import_module, (name,)


def _class(cls: type) -> tuple[Any, ...]:
    meta = type(cls)
    if meta not in _PLAIN_METACLASSES:
        raise pickle.PicklingError(f"class {cls.__qualname__} has metaclass {meta.__qualname__}")
    if "__slots__" in cls.__dict__:
        raise pickle.PicklingError(f"class {cls.__qualname__} has __slots__")
    attrs = {k: v for k, v in cls.__dict__.items() if k not in _CLASS_SKIP}
    state = {"attrs": attrs, "qualname": cls.__qualname__}
    return _make_class, (meta, cls.__name__, cls.__bases__), state, None, None, _set_class_state


# -- in the producer ---------------------------------------------------------------


def _new_namespace() -> dict[str, Any]:
    import builtins

    return {"__builtins__": builtins, "__name__": "__main__"}


def _make_function(namespace: dict[str, Any], code: bytes, name: str, ncells: int) -> types.FunctionType:
    closure = tuple(types.CellType() for _ in range(ncells)) if ncells else None
    return types.FunctionType(marshal.loads(code), namespace, name, None, closure)


def _set_function_state(fn: types.FunctionType, state: dict[str, Any]) -> types.FunctionType:
    fn.__globals__.update(state["globals"])
    fn.__defaults__ = state["defaults"]
    fn.__kwdefaults__ = state["kwdefaults"]
    for cell, value in zip(fn.__closure__ or (), state["cells"], strict=True):
        if value is not _Empty:
            cell.cell_contents = value
    fn.__dict__.update(state["dict"])
    fn.__qualname__ = state["qualname"]
    fn.__doc__ = state["doc"]
    fn.__module__ = "__main__"
    return fn


def _make_cached(fn: types.FunctionType, maxsize: int | None, typed: bool) -> Any:
    return functools.lru_cache(maxsize=maxsize, typed=typed)(fn)


def _make_class(meta: type, name: str, bases: tuple[type, ...]) -> type:
    return types.new_class(name, bases, {"metaclass": meta})


def _set_class_state(cls: type, state: dict[str, Any]) -> type:
    for key, value in state["attrs"].items():
        setattr(cls, key, value)
    cls.__qualname__ = state["qualname"]
    cls.__module__ = "__main__"
    if isinstance(cls, abc.ABCMeta):
        abc.update_abstractmethods(cls)  # type: ignore[arg-type]  # its abstract methods came after the class was made
    return cls
