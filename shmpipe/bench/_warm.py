"""Whether what a recipe starts once per process runs already: its first
batch is then warm, and the tables say so (a new job pays that start in its
first batch). Reads where each library keeps its state and imports nothing
of shmpipe: bench feed's start-up scripts call it before the clock of
their first batch from the loader's making (first_batch_s)."""

from __future__ import annotations

import sys
from multiprocessing.context import BaseContext

__all__ = ["multiprocessing_fork_server_running", "ray_running", "shmpipe_fork_server_running"]


def shmpipe_fork_server_running() -> bool:
    """shmpipe's fork server (where a pipeline of this process started it)."""
    server = sys.modules.get("shmpipe._forkserver")
    server_pid = getattr(server, "server_pid", None)
    return server_pid is not None and server_pid() is not None


def multiprocessing_fork_server_running(context: BaseContext) -> bool | None:
    """multiprocessing's own fork server (a Process or Queue of the
    forkserver context started it), for processes of `context`; None where
    they start from none."""
    if context.get_start_method() != "forkserver":
        return None
    forkserver = sys.modules.get("multiprocessing.forkserver")
    server = getattr(forkserver, "_forkserver", None)
    return getattr(server, "_forkserver_pid", None) is not None


def ray_running() -> bool:
    """Ray's runtime, for this driver."""
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())
