"""ProcessLauncher: runs a pipeline's producers as local processes.

Each producer gets a duplex control pipe (protocol in _worker.py). The
channel is opened here: at once, or -- for a transport sized by its first
batch, when the user gave no slot size -- once a producer reports the size
of its first batch ("need_channel"), after which every producer is told to
"attach".
"""

from __future__ import annotations

import dataclasses
import multiprocessing.connection
import multiprocessing.process
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from shmpipe import _control
from shmpipe._process import owner_identity
from shmpipe._worker import producer_main
from shmpipe.errors import WorkerDiedError, WorkerError
from shmpipe.transport import ChannelSpec, ConsumerEnd, Launcher, Transport

__all__ = ["GRACE_S", "ProcessLauncher"]

#: shutdown(): how long producers get to exit on their own before SIGTERM,
#: and again before SIGKILL.
GRACE_S = 1.0

#: The exit status of a producer that was still importing the user's script
#: (spawn and forkserver children run it again, as `__mp_main__`) when the
#: script started a pipeline: see _refuse_while_bootstrapping.
BOOTSTRAP_EXIT_CODE = 87


class ProcessLauncher(Launcher):
    """Starts one local process per source, watches them through their
    control pipes and exit codes, and owns the channel."""

    def __init__(
        self,
        transport: Transport,
        sources: Sequence[Callable[[], Iterable[Any]]],
        spec: ChannelSpec,
    ) -> None:
        self.transport = transport
        self.spec = spec
        self.channel: ConsumerEnd | None = None
        self.processes: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self._need: int | None = None  # largest first batch a producer asked a channel for
        self._failure: BaseException | None = None
        self._down = False
        _refuse_while_bootstrapping()
        lazy = transport.capabilities.sized_by_first_batch and spec.slot_size is None
        try:
            if not lazy:
                self.channel = transport.open(spec)
            self._start(sources)
        except BaseException:  # a Ctrl-C too: what was made is destroyed before it propagates
            self.shutdown()
            raise

    def _start(self, sources: Sequence[Callable[[], Iterable[Any]]]) -> None:
        ctx = self.spec.mp_context
        method = ctx.get_start_method()
        owner_pid, owner_start = owner_identity()
        # A channel opened before the producers goes with their arguments: some
        # handles (multiprocessing queues) can only travel that way.
        handle = self.channel.handle if self.channel is not None else None
        # Ctrl-C reaches every process of the terminal's process group, and a
        # producer still starting up would print a KeyboardInterrupt
        # traceback. A spawned child inherits an ignored SIGINT from birth
        # (Python installs its handler only over the default disposition),
        # and so does a forkserver child when the forkserver itself started
        # with SIGINT ignored: its children get the server's start-up
        # disposition. So SIGINT is ignored while the producers (and, the
        # first time, the forkserver) start; producer_main keeps it ignored.
        # A Ctrl-C in that window is lost (blocking it instead does not
        # help: NumPy's BLAS threads, which block nothing, would take it and
        # ignore it); a second one stops everything, and whatever was
        # started is shut down (__init__). A forkserver started earlier by
        # other code leaves a short window the other way.
        ignore = method in ("spawn", "forkserver") and threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignore else None
        try:
            for worker, source in enumerate(sources):
                parent_end, child_end = ctx.Pipe(duplex=True)
                self.conns.append(parent_end)
                p = ctx.Process(
                    target=producer_main,
                    args=(
                        worker, self.spec.num_workers, source, child_end, owner_pid, owner_start,
                        self.transport, handle,
                    ),
                    name=f"shmpipe-producer-{worker}",
                    daemon=True,
                )
                p.start()
                self.processes.append(p)
                child_end.close()
        finally:
            if ignore:
                signal.signal(signal.SIGINT, old)

    def _send_all(self, message: tuple[Any, ...]) -> None:
        """The same message to every producer (the channel's handle goes
        through the control connections, descriptors and all: _control)."""
        for conn in self.conns:
            _control.send(conn, message)

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.processes]

    def open_channel(self, wait: float) -> ConsumerEnd | None:
        if self.channel is None:
            self.wait_for_event(wait)
            self._read_messages()
            if self._need is not None:
                spec = dataclasses.replace(self.spec, slot_size=self.transport.slot_size_for(self._need))
                self.channel = self.transport.open(spec)
                self._send_all(("attach", self.channel.handle))
        return self.channel

    def begin_pass(self, pass_no: int, seeds: Sequence[int]) -> None:
        if self.channel is not None:
            self.channel.begin_pass(pass_no)
        for conn, seed in zip(self.conns, seeds, strict=True):
            _control.send(conn, ("pass", pass_no, seed))

    def wait_for_event(self, timeout: float) -> None:
        multiprocessing.connection.wait(self.conns + [p.sentinel for p in self.processes], timeout)

    def first_failure(self) -> BaseException | None:
        """Reads the producers' messages; the first failure, or None."""
        if self._down:
            return self._failure
        self._read_messages()
        if self._failure is None:
            for worker, p in enumerate(self.processes):
                code = p.exitcode  # read once: each read polls the process
                if code == BOOTSTRAP_EXIT_CODE and self.spec.mp_context.get_start_method() != "fork":
                    self._failure = WorkerDiedError(worker, p.pid, code, reason=_unguarded_script())
                    break
                if code is not None:
                    self._failure = WorkerDiedError(worker, p.pid, code)
                    break
        return self._failure

    def _read_messages(self) -> None:
        for worker, conn in enumerate(self.conns):
            try:
                while conn.poll():
                    self._on_message(worker, _control.recv(conn))
            except (EOFError, OSError):
                pass  # it died; its exit code says how

    def _on_message(self, worker: int, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "need_channel":
            self._need = max(self._need or 0, msg[1])
        elif kind == "error" and self._failure is None:
            _, exc_type, message, tb, own = msg
            error = WorkerError(worker, self.processes[worker].pid, exc_type, message, tb)
            if own is not None:
                # shmpipe's own error in the producer (BatchTypeError, ...):
                # raise its type, so `except TypeError` works, chained to the
                # WorkerError that says which worker and where.
                own.__cause__ = error
                error = own
            self._failure = error

    def halt(self) -> None:
        for conn in self.conns:
            try:
                _control.send(conn, ("stop",))
            except (OSError, ValueError):
                pass

    def shutdown(self) -> None:
        if self._down:
            return
        self._down = True
        channel = self.channel
        if channel is not None:
            channel.close()  # producers waiting for room return at once
        for conn in self.conns:
            try:
                _control.send(conn, ("stop",))
            except (OSError, ValueError):
                pass
        if channel is not None:
            try:
                channel.destroy()  # shared names go now; live arrays keep their memory
            except OSError:
                pass
        _reap(self.processes)
        for conn in self.conns:
            conn.close()
        self.channel = None

    def leftovers(self) -> list[str]:
        """What is still running after shutdown (for tests): nothing, we hope."""
        return [f"producer process {p.pid}" for p in self.processes if p.exitcode is None]


def _main_script() -> str:
    """The user's script, as a path when it has one."""
    main = sys.modules.get("__mp_main__") or sys.modules.get("__main__")
    return str(getattr(main, "__file__", None) or getattr(main, "__name__", "the main module"))


def _unguarded_script() -> str:
    script = _main_script()
    return (
        f"could not start: {script} starts a pipeline when it is imported, and a producer process "
        f"imports it again. Put the code that starts the pipeline under `if __name__ == \"__main__\":` "
        f"in {script}"
    )


def _refuse_while_bootstrapping() -> None:
    """In a spawn or forkserver child still importing the user's script (the
    stdlib's own test, multiprocessing.spawn._check_not_importing_main):
    the script starts a pipeline at import, without a main guard. Starting
    producers here would fail anyway, with a long RuntimeError traceback
    from the standard library in every producer's output. Instead this
    child exits at once, quietly, with BOOTSTRAP_EXIT_CODE, and the consumer
    raises a WorkerDiedError that names the script and the fix (one message,
    not one per producer). os._exit: the half-imported script must not go
    on, and this process holds nothing to clean up."""
    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        os._exit(BOOTSTRAP_EXIT_CODE)


def _reap(processes: list[BaseProcess]) -> None:
    deadline = time.monotonic() + GRACE_S
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for sig_method in ("terminate", "kill"):
        alive = [p for p in processes if p.exitcode is None]
        if not alive:
            break
        for p in alive:
            getattr(p, sig_method)()
        deadline = time.monotonic() + GRACE_S
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))

