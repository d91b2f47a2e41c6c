"""Transports by name: the built-in ones, those registered at run time, and
those other packages declare in the entry-point group ``shmpipe.transports``.

A third-party package makes its transport available to everyone who installs
it with, in its pyproject.toml::

    [project.entry-points."shmpipe.transports"]
    mytransport = "mypackage.module:MyTransport"

Nothing is imported until a transport is asked for by name, so ``import
shmpipe`` stays light (no Ray, no Arrow). The built-in transports are found
the same way as anyone's: by the path of their class, never imported by
name, and each one's module says what it needs (``transport.require``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from shmpipe.errors import ShmpipeTypeError, ShmpipeValueError, TransportUnavailableError
from shmpipe.transport import Transport, not_installed

if TYPE_CHECKING:
    import importlib.metadata

__all__ = ["ENTRY_POINT_GROUP", "available_transports", "get_transport", "register_transport", "resolve_transport"]

ENTRY_POINT_GROUP = "shmpipe.transports"

#: name -> "module:Class" of the transports that come with shmpipe
_BUILTIN: dict[str, str] = {
    "shm": "shmpipe.transports.shm:ShmTransport",
    "arrow": "shmpipe.transports.arrow:ArrowTransport",
    "ray": "shmpipe.transports.ray:RayTransport",
    "queue": "shmpipe.transports.queue:QueueTransport",
}

_registered: dict[str, type[Transport]] = {}


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    # Imported here: only a name that is no built-in transport's needs it,
    # and it costs a script that imports only NumPy 10-16 ms (measured).
    import importlib.metadata

    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_transports() -> list[str]:
    """Names of every transport: built in, registered, or installed by
    another package (entry points are listed, not imported)."""
    return sorted(set(_BUILTIN) | set(_registered) | set(_entry_points()))


def register_transport(name: str, cls: type[Transport], *, replace: bool = False) -> None:
    """Makes `cls` available as ``transport=name``.

    A name already taken (built in, registered, or from an entry point) is an
    error unless ``replace=True``.
    """
    if not isinstance(name, str) or not name:
        raise ShmpipeTypeError(f"a transport name must be a non-empty str, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise ShmpipeTypeError(f"{cls!r} is not a subclass of shmpipe.transport.Transport")
    if not replace and (name in _BUILTIN or name in _registered or name in _entry_points()):
        raise ShmpipeValueError(
            f"a transport named {name!r} already exists; pass replace=True to replace it"
        )
    _registered[name] = cls


def _check_requires(name: str, cls: type[Transport]) -> None:
    for module in cls.requires:
        if importlib.util.find_spec(module) is None:
            raise not_installed(module, name, cls.extra, cls.install)


def get_transport(name: str) -> type[Transport]:
    """The Transport class registered as `name`."""
    if name in _registered:
        cls = _registered[name]
    elif name in _BUILTIN:
        module, _, attr = _BUILTIN[name].partition(":")
        # A missing dependency is a TransportUnavailableError from the
        # module's own transport.require().
        cls = getattr(importlib.import_module(module), attr)
    else:
        ep = _entry_points().get(name)
        if ep is None:
            raise ShmpipeValueError(
                f"unknown transport {name!r}; known transports: {', '.join(available_transports())}"
            )
        try:
            cls = ep.load()
        except TransportUnavailableError:
            raise  # the plugin's own transport.require() said what to install
        except ImportError as exc:
            raise TransportUnavailableError(
                f"the {name!r} transport (entry point {ep.value!r} of "
                f"{getattr(ep.dist, 'name', 'an installed package')}) failed to import: {exc}"
            ) from exc
        if not (isinstance(cls, type) and issubclass(cls, Transport)):
            raise ShmpipeTypeError(
                f"entry point {name!r} = {ep.value!r} is not a shmpipe.transport.Transport subclass"
            )
    _check_requires(name, cls)
    return cls


def resolve_transport(transport: Any) -> Transport:
    """A Transport instance from a name, a Transport class or an instance."""
    if isinstance(transport, Transport):
        return transport
    if isinstance(transport, type) and issubclass(transport, Transport):
        return transport()
    if isinstance(transport, str):
        return get_transport(transport)()
    raise ShmpipeTypeError(
        f"transport must be a name ({', '.join(available_transports())}), a Transport subclass "
        f"or an instance, not {type(transport).__name__}"
    )
