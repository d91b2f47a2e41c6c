"""How a producer's process starts where shmpipe's fork server does not
fork it (spawn; and the producers that import the script: multiprocessing's
own fork server, or spawn), and what every child reads first
(pickled_for_child: shmpipe's fork server's children too).

multiprocessing's classes, each with its start changed where a child that
ends in the middle of it hurt the trainer: its data written with SIGPIPE
held off (_interrupts.no_sigpipe: a program may have restored SIGPIPE's
default action), and the pipe the child reads closed on the trainer's side
before the write, so that the write fails rather than waits for ever.
"""

from __future__ import annotations

import io
import os
from multiprocessing import forkserver, popen_forkserver, popen_spawn_posix, reduction, spawn, util
from multiprocessing.context import set_spawning_popen
from multiprocessing.process import BaseProcess
from typing import Any

from shmpipe._interrupts import no_sigpipe, resource_tracker_running
from shmpipe.errors import ShmpipeError

__all__ = ["ScriptServerProcess", "ScriptSpawnProcess", "SpawnProcess", "pickled_for_child"]


def _preparation_data(name: str) -> dict[str, Any]:
    """multiprocessing's preparation data for a child, less the script."""
    data: dict[str, Any] = spawn.get_preparation_data(name)
    data.pop("init_main_from_path", None)
    data.pop("init_main_from_name", None)
    return data


def pickled_for_child(popen: Any, process_obj: BaseProcess, tells_the_script: bool = False) -> io.BytesIO:
    """What a child reads first, pickled as multiprocessing pickles it: the
    preparation data (less the script, unless `tells_the_script`), then the
    process object, with `popen` taking the descriptors that travel along."""
    buf = io.BytesIO()
    set_spawning_popen(popen)
    try:
        name = process_obj.name
        prepared = spawn.get_preparation_data(name) if tells_the_script else _preparation_data(name)
        reduction.dump(prepared, buf)
        reduction.dump(process_obj, buf)
    finally:
        set_spawning_popen(None)
    return buf


class _SpawnPopen(popen_spawn_posix.Popen):
    """A spawned child told nothing of the script (popen_spawn_posix.Popen._launch
    with the preparation data changed, and a child that ends before it read
    its data an error, not a write that waits for ever)."""

    tells_the_script = False

    def _launch(self, process_obj: BaseProcess) -> None:
        from multiprocessing import resource_tracker

        with no_sigpipe():  # (its check of the tracker writes to the tracker's pipe)
            tracker_fd = resource_tracker.getfd()
        self._fds.append(tracker_fd)  # type: ignore[attr-defined]
        fp = pickled_for_child(self, process_obj, self.tells_the_script)

        parent_r = child_w = child_r = parent_w = None
        try:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            cmd = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            self._fds.extend([child_r, child_w])  # type: ignore[attr-defined]
            self.pid = util.spawnv_passfds(spawn.get_executable(), cmd, self._fds)  # type: ignore[arg-type,attr-defined]
            self.sentinel = parent_r
            # The child has its own copies. Ours are closed before the write
            # (multiprocessing's after it): with our read end open, a child
            # that ended before it read its data, past a pipe's 64 KiB,
            # left the write waiting for ever (the pipeline's timeout did
            # not apply, nor a Ctrl-C: blocked in the start).
            os.close(child_r)
            os.close(child_w)
            child_r = child_w = None
            # Closed once written, as for the fork server's producers.
            with open(parent_w, "wb", closefd=True) as f, no_sigpipe():
                parent_w = None
                f.write(fp.getbuffer())
        except BrokenPipeError as exc:
            raise ShmpipeError(f"{process_obj.name} (pid {self.pid}) ended before it read what it starts with") from exc
        finally:
            if parent_w is not None:
                os.close(parent_w)
            fds_to_close = [parent_r] if parent_r is not None else []
            self.finalizer = util.Finalize(self, util.close_fds, fds_to_close)  # type: ignore[attr-defined]
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)


class _ScriptSpawnPopen(_SpawnPopen):
    """A spawned child that imports the script (_startup's fallback)."""

    tells_the_script = True


class _ScriptServerPopen(popen_forkserver.Popen):
    """A child of multiprocessing's own fork server, which imports the
    script (_startup's fallback): its request and data are written inside
    no_sigpipe, the tracker and that server started before it (a process
    started inside would be born with SIGPIPE blocked, the server's
    children with it)."""

    def _launch(self, process_obj: BaseProcess) -> None:
        resource_tracker_running()
        forkserver.ensure_running()
        try:
            with no_sigpipe():
                super()._launch(process_obj)  # type: ignore[misc]
        except BrokenPipeError as exc:
            raise ShmpipeError(f"{process_obj.name} ended before it read what it starts with") from exc


class SpawnProcess(BaseProcess):
    """A producer spawned without the script."""

    _start_method = "spawn"

    @staticmethod
    def _Popen(process_obj: BaseProcess) -> _SpawnPopen:  # noqa: N802 (multiprocessing's name)
        return _SpawnPopen(process_obj)


class ScriptServerProcess(BaseProcess):
    """A producer that imports the script, forked from multiprocessing's
    own fork server (multiprocessing's ForkServerProcess, started safely)."""

    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj: BaseProcess) -> _ScriptServerPopen:  # noqa: N802 (multiprocessing's name)
        return _ScriptServerPopen(process_obj)


class ScriptSpawnProcess(BaseProcess):
    """A producer that imports the script, spawned (multiprocessing's
    SpawnProcess, started safely)."""

    _start_method = "spawn"

    @staticmethod
    def _Popen(process_obj: BaseProcess) -> _ScriptSpawnPopen:  # noqa: N802 (multiprocessing's name)
        return _ScriptSpawnPopen(process_obj)
