"""ProcessLauncher: runs a pipeline's producers as local processes.

Each producer gets a duplex control pipe (protocol in _worker.py). The
channel is opened here: at once, or -- for a transport sized by its first
batch, when the user gave no slot size -- once a producer reports the size
of its first batch ("need_channel"), after which every producer is told to
"attach".

What a producer sends is untrusted: it is read without ever blocking, by
a _control.ProducerLink per producer (JSON, checked field by field, reassembled
from whatever has arrived), at each health check. A message cut short by
a producer that stopped or died waits in its link, and no wait here
outlasts the pipeline's timeout; a malformed one is a CorruptChannelError
that names the producer. A message to a producer that is gone (the next
pass, attach) is the WorkerDiedError that names it, not the socket's
BrokenPipeError.

A producer's end is seen by a pidfd (_process.ProcessWatch) as well as by
multiprocessing's sentinel. With fork and spawn the sentinel is a pipe whose
write end the producer holds, and so does any child it forks: while such a
child runs, the sentinel says nothing, and waiting on it alone (a join with
a timeout) waited out the whole timeout for a producer long gone. Its exit
code, read as before through multiprocessing, says how it ended.
"""

from __future__ import annotations

import contextlib
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
from typing import Any, Protocol

from shmpipe import _control, _forkserver, _spans, _startup
from shmpipe._descriptors import check_descriptor_room
from shmpipe._interrupts import WaitEndedByCtrlC, born_with_ctrl_c_blocked, ctrl_c_held_back, ctrl_c_pending
from shmpipe._process import ProcessWatch, owner_identity, process_stopped
from shmpipe._producer_context import PassWork
from shmpipe._worker import producer_main
from shmpipe.errors import CorruptChannelError, PipelineClosedError, WorkerDiedError, WorkerError
from shmpipe.transport import ChannelSpec, ConsumerEnd, Launcher, Transport

__all__ = ["GRACE_S", "ProcessLauncher", "prestart"]

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
        shipments: _startup.Shipments | None = None,
        *,
        may_start_in_background: bool = False,
        timeout: float | None = None,
    ) -> None:
        self.transport = transport
        #: How long a producer's start started from the caller's thread waits
        #: for the fork server (the pipeline's timeout; _spawn)
        self._timeout = timeout
        self.spec = spec
        self.channel: ConsumerEnd | None = None
        self.processes: list[_Producer] = []
        self.watches: list[ProcessWatch] = []  # one per process, in the same order
        #: The consumer's end of each producer's control connection: what
        #: it is sent, and what it says, read without blocking.
        self.links: list[_control.ProducerLink] = []
        self._reading = threading.Lock()  # one thread at a time takes apart what arrived
        #: Held while the launcher adds to what shutdown stops (a producer's
        #: replacement, the channel a first batch sized), and by shutdown as
        #: it marks the launcher down: what another thread adds as the
        #: pipeline closes is either refused or stopped with the rest.
        self._adding = threading.RLock()
        #: Each hold of _adding or _reading outside shutdown is a span: a close()
        #: from a signal handler that interrupts the main thread there is put
        #: off to the span's end (it would wait for its own thread's lock)
        self._spans = _spans.TeardownAfterSpans()
        self._need: int | None = None  # largest first batch a producer asked a channel for
        self._pass_no = spec.first_pass  # the pass begun last: a channel opened later starts there
        #: per worker: (pass, batches) of the last "done" it sent
        self._ended: list[tuple[int, int] | None] = [None] * spec.num_workers
        #: per worker: (pass, wseq) -> its source's iterator's state after that batch
        self._iterator_states: list[dict[tuple[int, int], Any]] = [{} for _ in range(spec.num_workers)]
        #: How many of each producer's last states are kept: a producer is
        #: never more than the ring's capacity ahead of what was taken, and
        #: a state is of what was taken, or less an adapter's batches taken
        #: ahead of the trainer (keep_iterator_states).
        self._states_kept = spec.capacity + 2
        self._failure: BaseException | None = None
        self._down = False  # shutdown begun: nothing more is added
        self._stopped = False  # shutdown done, to its end (a cut one runs again)
        # The thread that starts the producers, while it does (see starting);
        # set once it is done; what it raised; whether shutdown asked it to
        # start no more; and whether the channel's handle_delivered is still
        # to be called (from the consumer's thread, once the start is over:
        # _started). Whether the start is over is the event's word, never
        # the thread's join() or is_alive(): on Python 3.11 a Ctrl-C that
        # interrupts a join() marks a thread still running as ended
        # (CPython gh-90882), and the next pass then sent work to producers
        # the start had not yet linked (an IndexError, helper 55).
        self._starter: threading.Thread | None = None
        self._start_done = threading.Event()
        self._start_failure: BaseException | None = None
        self._stop_starting = False
        self._handle_owed = False
        _refuse_while_bootstrapping()
        check_descriptor_room(transport, spec.mp_context.get_start_method(), len(sources))
        lazy = transport.capabilities.sized_by_first_batch and spec.slot_size is None
        try:
            if not lazy:
                self.channel = transport.open(spec)
            self.sources = list(sources)
            # Each producer imports what its source needs, not the trainer's
            # script, where the source can travel without it (_startup); a
            # restarted producer starts the same way (_spawn). What the options'
            # check pickled goes as it is (shipments). (Here, in the caller's
            # thread: it may warn, naming the caller's line.)
            self._plan = _startup.plan(spec.mp_context, self.sources, transport, shipments)
            if may_start_in_background and self._start_waits_for_a_new_process():
                if spec.mp_context.get_start_method() == "forkserver":
                    # The server's process is launched from this thread (a
                    # fork and exec, milliseconds) so that its boot begins
                    # now: in the thread it waited for the GIL, held by the
                    # trainer making its first batches, and for any garbage
                    # collection that fell meanwhile (up to 0.1 s after
                    # import torch, measured). Ctrl-C is held back as
                    # around prestart: it would leave a server half-made.
                    with ctrl_c_held_back():
                        _forkserver.launch_server()
                self._handle_owed = self.channel is not None
                self._starter = threading.Thread(target=self._start_in_background, name="shmpipe-start", daemon=True)
                try:
                    self._starter.start()
                except BaseException:
                    self._starter = None  # never ran: nothing to wait for (_start_done is never set)
                    raise
            else:
                self._start()
                if self.channel is not None:
                    # Each producer holds its own copy of what the handle names
                    # now (forked with it, or passed it at its start, before
                    # start() returned): the consumer's may go.
                    self.channel.handle_delivered()
        except BaseException:  # a Ctrl-C too: what was made is destroyed before it propagates
            self.shutdown()
            raise

    def _start_waits_for_a_new_process(self) -> bool:
        """Whether starting the producers waits for a new interpreter to
        boot: each producer's own (spawn), or the fork server's, not running
        yet (forkserver; 0.15-0.2 s, measured, with a dataset's modules to
        preload). Only such a start runs in the background: every source
        travels as the bytes the options' check pickled (nothing of the
        trainer's objects is read in that thread while the trainer uses
        them), and no thread forks this process (start method fork)."""
        method = self.spec.mp_context.get_start_method()
        if method == "fork" or not all(isinstance(s, _startup.Shipped) for s in self._plan.sources):
            return False
        return method == "spawn" or _forkserver.server_pid() is None

    @property
    def starting(self) -> bool:
        """Whether the producers are still being started, in the background:
        meanwhile the consumer may make batches itself (Pipeline,
        shmpipe/_first_batches.py). Every other method waits for the start
        to end first."""
        return self._starter is not None and not self._start_done.is_set()

    def _start_in_background(self) -> None:
        try:
            if self.spec.mp_context.get_start_method() == "forkserver":
                # The resource tracker, which _start starts first, boots only
                # once the server has (launch_server says why); the starts
                # wait for that boot anyway.
                _forkserver.wait_until_booted(_forkserver.StartWait(None, self._start_abandoned))
            self._start()
        except BaseException as exc:  # noqa: BLE001 - raised in the consumer's thread, by _started
            self._start_failure = exc
        finally:
            self._start_done.set()

    def wait_for_start(self, timeout: float) -> None:
        if self._starter is not None:
            self._start_done.wait(timeout)

    def _start_ended(self) -> None:
        """Waits for a start in the background to end (the wait a consumer
        without one made in its constructor: the fork server's boot and one
        connection per producer; a pipeline's own waits go through
        wait_for_start, within its timeout); what it raised becomes the
        launcher's failure."""
        starter = self._starter
        if starter is None:
            return
        self._start_done.wait()
        starter.join()  # (its last instructions: the start is over)
        self._starter = None
        if self._start_failure is not None and self._failure is None:
            self._failure = self._start_failure

    def _started(self) -> None:
        """_start_ended, for a method that needs every producer: a start
        that failed is raised (what it started is stopped by shutdown);
        one that succeeded lets the channel drop the consumer's copy of
        its handle now, in the consumer's thread, before any take."""
        self._start_ended()
        if self._start_failure is not None:
            raise self._start_failure
        if self._handle_owed and self.channel is not None:
            self._handle_owed = False
            self.channel.handle_delivered()

    def _start(self) -> None:
        # A channel opened before the producers goes with their arguments: some
        # handles (multiprocessing queues) can only travel that way.
        handle = self.channel.handle if self.channel is not None else None
        # (In a thread of its own, born_with_ctrl_c_blocked blocks SIGINT in
        # that thread only: its children are still born with it blocked.)
        with born_with_ctrl_c_blocked(self.spec.mp_context.get_start_method()) as block_again:
            for worker in range(len(self.sources)):
                if self._stop_starting:  # shutdown is waiting: no more (what was started is stopped there)
                    break
                p, parent_end = self._spawn(worker, handle)
                self.links.append(_control.ProducerLink(parent_end, f"worker {worker} (pid {p.pid})"))
                self.processes.append(p)
                # No start time needed: until it is reaped (by us, or by
                # the forkserver), its pid is not reused.
                self.watches.append(ProcessWatch(_pid(p)))
                block_again()

    def _spawn(self, worker: int, handle: Any) -> tuple[BaseProcess, Connection]:
        """Starts producer `worker`'s process (SIGINT blocked: the caller
        is in born_with_ctrl_c_blocked); returns it and the consumer's end
        of its control connection."""
        owner_pid, owner_start = owner_identity()
        parent_end, child_end = self.spec.mp_context.Pipe(duplex=True)
        p = self._plan.process_types[worker](
            target=producer_main,
            args=(
                worker, self.spec.num_workers, self._plan.sources[worker], child_end, owner_pid, owner_start,
                self.transport, handle,
            ),
            name=f"shmpipe-producer-{worker}",
            daemon=True,
        )
        # From the caller's thread, a server stopped for the pipeline's
        # timeout fails the start; in the background nothing does (the
        # trainer's next() waits for the start within its own timeout, and
        # close() abandons it), so a start is not failed while the trainer
        # does other things.
        background = threading.current_thread() is self._starter
        wait = _forkserver.StartWait(None if background else self._timeout, self._start_abandoned)
        try:
            with _forkserver.waiting(wait):
                p.start()
        except BaseException:
            # A child the server forks after this start gave up (stopped,
            # then continued) finds its control pipe closed, and ends.
            parent_end.close()
            raise
        finally:
            child_end.close()
        assert p.pid is not None  # started
        return p, parent_end

    def _start_abandoned(self, what: str) -> BaseException | None:
        """The error a producer's start still waiting for the fork server
        gives up with (_forkserver.StartWait; `what` names the start), or
        None: shutdown asked for no more starts, or, in the main thread
        (whose SIGINT born_with_ctrl_c_blocked keeps pending meanwhile), a
        Ctrl-C was pressed."""
        if self._stop_starting:
            return PipelineClosedError(f"the pipeline was closed {what}")
        if ctrl_c_pending():
            return WaitEndedByCtrlC(f"Ctrl-C was pressed {what}")
        return None

    can_restart = True

    def restart(self, worker: int) -> int:
        """Replaces producer `worker`, whose process has ended, by a new one
        attached to the channel (transports that restarts_producers: the
        handle can be given again). Returns the new process's pid. The new
        producer runs nothing until it is sent a pass (send_pass)."""
        self._started()
        closed = PipelineClosedError(f"the pipeline was closed: producer {worker} is not replaced")
        with self._spans, self._adding:
            # Closed since the death was seen, or being closed: by another
            # thread, or by a signal handler whose close waits for this span
            if self._down or self._stop_starting:
                raise closed
            old, watch = self.processes[worker], self.watches[worker]
            _join(old, watch, time.monotonic() + GRACE_S)  # reaped: its pid is not ours any more
            with self._reading:
                self.links[worker].close()  # a message it left half-sent goes with it
            watch.close()
            if self._stop_starting:  # (as the join waited)
                raise closed
            handle = self.channel.replacement_handle(worker) if self.channel is not None else None
            with born_with_ctrl_c_blocked(self.spec.mp_context.get_start_method()):
                p, conn = self._spawn(worker, handle)
                # Recorded before the block's end raises a press held pending;
                # one statement: no signal handler runs between the two stores
                self.processes[worker], self.watches[worker] = p, ProcessWatch(_pid(p))
                with self._reading:
                    self.links[worker] = _control.ProducerLink(conn, f"worker {worker} (pid {p.pid})")
            if isinstance(self._failure, WorkerDiedError) and self._failure.worker_id == worker:
                self._failure = None  # that death is dealt with
        if self._down:  # a signal handler's close() in the span: the replacement was stopped as it ended
            raise closed
        return _pid(p)

    def send_pass(self, worker: int, work: PassWork) -> None:
        """Pass `work.pass_no`, already begun, for producer `worker` alone (a
        replacement, which goes on where its predecessor stopped)."""
        self._started()
        self._send(worker, ("pass", work))

    def _send(self, worker: int, message: tuple[Any, ...]) -> None:
        """`message` to producer `worker`. One that is gone (its end of the
        connection closed: BrokenPipeError, ConnectionResetError) is the
        pipeline's failure, raised: the WorkerDiedError that names it (or
        the error it reported before it went)."""
        lost = self._send_each([(worker, message)])
        if lost is not None:
            raise lost

    def _send_each(self, messages: Iterable[tuple[int, tuple[Any, ...]]]) -> BaseException | None:
        """Each (worker, message) sent, also past a producer found gone
        (the pipeline may replace it, and tells the replacement itself):
        the first such death, to raise once the others are told, or None.
        The deaths found share one GRACE_S for their exit statuses: N
        producers gone at once wait 1 s, not N."""
        deadline: float | None = None
        lost: BaseException | None = None
        for worker, message in messages:
            try:
                self.links[worker].send(message)
            except OSError:
                deadline = deadline or time.monotonic() + GRACE_S
                failure = self._lost(worker, deadline)
                lost = lost or failure
        return lost

    def _send_quietly(self, message: tuple[Any, ...]) -> None:
        """`message` to every producer still there (stop: one that is gone
        needs no telling, and its end is reported where it is read)."""
        for link in self.links:
            try:
                link.send(message)
            except (OSError, ValueError):  # ValueError: a connection closed already
                pass

    def _lost(self, worker: int, deadline: float) -> BaseException:
        """Producer `worker`'s connection is closed: the failure to raise.
        It is ending, if it has not ended (its connection closes as it
        exits): its exit code is waited for until `deadline` (monotonic)."""
        if self._down:  # its link was closed by a close() in another thread, not by its end
            return PipelineClosedError("the pipeline was closed")
        p = self.processes[worker]
        _join(p, self.watches[worker], deadline)
        failure = self.first_failure()  # an error it reported before it went comes first
        if failure is None:
            if self.watches[worker].alive():
                reason = "its control connection closed while it was still running"
            else:  # ended; its exit status comes through the fork server, late (first_failure: not a stopped one)
                reason = f"it ended, and its exit status did not come within {GRACE_S:g} s"
            failure = self._failure = WorkerDiedError(worker, p.pid, None, reason=reason)
        return failure

    @property
    def pids(self) -> list[int | None]:
        self._start_ended()
        return [p.pid for p in self.processes]

    def open_channel(self, wait: float) -> ConsumerEnd | None:
        self._started()
        if self.channel is None:
            self.wait_for_event(wait)
            self._read_messages()
            if self._need is not None:
                spec = dataclasses.replace(
                    self.spec, slot_size=self.transport.slot_size_for(self._need), first_pass=self._pass_no
                )
                with self._spans, self._adding:  # (a close() meanwhile destroys it after, or finds none)
                    if self._down or self._stop_starting:  # (as restart)
                        raise PipelineClosedError("the pipeline was closed")
                    self.channel = channel = self.transport.open(spec)
                    # A replacement of a producer found gone starts attached.
                    lost = self._send_each((worker, ("attach", channel.handle)) for worker in range(len(self.links)))
                    channel.handle_delivered()  # the descriptors are in flight: the kernel holds them
                    del channel  # (a failure raised here keeps this frame, which would keep the ring mapped)
                if self._down:  # closed by a signal handler in the span: destroyed as it ended
                    raise PipelineClosedError("the pipeline was closed")
                if lost is not None:
                    raise lost
        return self.channel

    def begin_pass(self, pass_no: int, work: Sequence[PassWork]) -> None:
        self._started()
        self._pass_no = pass_no
        if self.channel is not None:
            self.channel.begin_pass(pass_no)
        # A replacement of a producer found gone is sent its part with send_pass.
        lost = self._send_each((worker, ("pass", w)) for worker, w in enumerate(work))
        if lost is not None:
            raise lost

    def wait_for_event(self, timeout: float) -> None:
        self._start_ended()
        if self._down or self._start_failure is not None:
            return
        # A producer's connection at its end is ready for ever: not waited on
        # (its process's end is, and says more).
        readable = [link for link in self.links if not link.eof]
        _wait_for_event(self.processes, self.watches, readable, timeout)

    def first_failure(self) -> BaseException | None:
        """Reads the producers' messages; the first failure, or None."""
        self._start_ended()
        if self._down:
            return self._failure
        self._read_messages()
        if self._failure is None:
            for worker, p in enumerate(self.processes):
                code = p.exitcode  # read once: each read polls the process
                if code is not None:
                    self._failure = self._died(worker, code)
                    break
                # Ended, its status held in the stopped fork server. Its
                # control pipe says so as well, unless the server stopped
                # before it closed its copy of the pipe's end as it forked the
                # producer: then only the pidfd tells (a PipelineTimeoutError
                # after the timeout, the death only in its words: 1 in 10 runs
                # of a loaded machine).
                if not self.watches[worker].alive() and _forkserver.status_held_back(p):
                    self._failure = self._held_back_death(worker)
                    break
        return self._failure

    def _held_back_death(self, worker: int) -> WorkerDiedError:
        reason = f"it ended, and its exit status has not come: {_forkserver.stopped_note()}"
        return WorkerDiedError(worker, self.processes[worker].pid, None, reason=reason)

    def _died(self, worker: int, code: int) -> WorkerDiedError:
        p = self.processes[worker]
        lost = _forkserver.status_lost(p)
        if lost is not None:
            return WorkerDiedError(worker, p.pid, None, reason=lost)
        if code == BOOTSTRAP_EXIT_CODE and self.spec.mp_context.get_start_method() != "fork":
            return WorkerDiedError(worker, p.pid, code, reason=_unguarded_script())
        return WorkerDiedError(worker, p.pid, code)

    def _read_messages(self) -> None:
        """Takes what every producer has sent so far, without blocking (a
        message not whole yet waits in its link)."""
        with self._spans, self._reading:
            for worker, link in enumerate(self.links):
                try:
                    messages = link.read()
                except CorruptChannelError as exc:
                    if self._failure is None:
                        self._failure = exc
                    continue
                for msg in messages:
                    self._on_message(worker, msg)

    def _on_message(self, worker: int, msg: _control.Message) -> None:
        if isinstance(msg, _control.NeedChannel):
            self._need = max(self._need or 0, msg.nbytes)
        elif isinstance(msg, _control.PassDone):
            self._ended[worker] = (msg.pass_no, msg.produced)
        elif isinstance(msg, _control.IteratorState):
            # The last few only (_states_kept): the state of the batch the
            # trainer had last is among them, and a flood costs nothing.
            states = self._iterator_states[worker]
            states[(msg.pass_no, msg.wseq)] = msg.state
            while len(states) > self._states_kept:
                del states[min(states)]
        elif self._failure is None:
            pid = self.processes[worker].pid
            error: BaseException = WorkerError(worker, pid, msg.exc_type, msg.message, msg.traceback)
            own = msg.own
            if own is not None:
                # shmpipe's own error in the producer (BatchTypeError, ...),
                # rebuilt from its arguments: raise its type, so `except
                # TypeError` works, chained to the WorkerError that says
                # which worker and where.
                own.__cause__ = error
                error = own
            self._failure = error

    reports_ends = True

    def reported_end(self, worker: int, pass_no: int) -> int | None:
        """How many batches producer `worker` said it published in pass
        `pass_no` when its part ended; None if it has not said so."""
        self._start_ended()
        self._read_messages()
        ended = self._ended[worker]
        return ended[1] if ended is not None and ended[0] == pass_no else None

    def keep_iterator_states(self, behind: int) -> None:
        """Keeps enough states for one made `behind` batches behind those
        taken (an adapter's thread takes that many ahead of the trainer)."""
        self._states_kept = max(self._states_kept, self.spec.capacity + 2 + behind)

    def iterator_state(self, worker: int, pass_no: int, wseq: int) -> tuple[bool, Any]:
        """(True, the state producer `worker`'s iterator had after its batch
        `wseq` of pass `pass_no`), where it sent one; (False, None) else."""
        self._start_ended()
        self._read_messages()
        key = (pass_no, wseq)
        states = self._iterator_states[worker]
        return (True, states[key]) if key in states else (False, None)

    def halt(self) -> None:
        self._start_ended()
        self._send_quietly(("stop",))

    def closing(self) -> None:
        self._stop_starting = True  # a replacement waiting for the fork server gives up

    def shutdown(self) -> None:
        # A Ctrl-C is held back to the end: a shutdown cut in the middle is
        # owed again (the stream's _finalize), but a Ctrl-C should not leave
        # the producers running until the next close().
        self.closing()  # (first)
        if self._spans.defer(self.shutdown):  # a signal handler's, in this thread's span: done as it ends
            return
        with ctrl_c_held_back():
            self._shutdown()

    def _shutdown(self) -> None:
        if self._stopped:
            return
        self._start_ended()  # what it started is stopped below with the rest
        # Each part in a finally: an exception from a signal handler (its own
        # close(), then sys.exit()) cuts the part it lands in, not the rest.
        # Once down, nothing changes self.channel but _stop_the_rest. A
        # shutdown cut anywhere (by another signal's handler: Ctrl-C is held
        # back) is owed again (the stream's _finalize) and runs again to its
        # end: each part is idempotent.
        try:
            with self._adding:  # after what is being added: it is stopped with the rest
                self._down = True
            if self.channel is not None:
                self.channel.close()  # producers waiting for room return at once
            self._send_quietly(("stop",))
        finally:
            if self._down:
                self._stop_the_rest(self.channel)

    def _stop_the_rest(self, channel: ConsumerEnd | None) -> None:
        """_shutdown's second part: the channel's names, the producers, their
        watches and links. Stopped only where it ran to its end: cut (by a
        handler's exception), it runs again with the next shutdown, and the
        channel is let go only once it was destroyed."""
        destroyed = False
        try:
            if channel is not None:
                with contextlib.suppress(OSError):
                    channel.destroy()  # shared names go now; live arrays keep their memory
            destroyed = True
            for p in self.processes[len(self.watches) :]:  # a start cut (by a handler's exception) before its watch
                self.watches.append(ProcessWatch(_pid(p)))
            _reap(self.processes, self.watches)
        finally:  # (where the reap is cut short, the links' close ends the producers)
            for watch in self.watches:
                watch.close()
            self.processes = [p if p.exitcode is None else _Ended(p) for p in self.processes]  # (new list: _Ended)
            with self._reading:  # not under a read in another thread (each is short: nothing blocks)
                for link in self.links:
                    link.close()
            if destroyed:
                self.channel = None
        self._stopped = True

    def describe_stall(self) -> str:
        """Producers that ended whose exit status has not come (it comes
        through the fork server), and a stopped fork server. (No wait for a
        start in the background: a snapshot of what it started so far.)"""
        pairs = zip(list(self.processes), list(self.watches), strict=False)  # (the start may be appending)
        ended = [p.pid for p, watch in pairs if p.exitcode is None and not watch.alive()]
        notes = [f"producer process(es) {ended} ended, their exit status not reported yet"] if ended else []
        stopped = _forkserver.stopped_note()
        if stopped:
            notes.append(stopped)
        return "".join(f"; {note}" for note in notes)

    def leftovers(self) -> list[str]:
        """What is still running after shutdown (for tests): nothing, we hope."""
        self._start_ended()
        return [
            f"producer process {p.pid}"
            for p, watch in zip(self.processes, self.watches, strict=True)
            if p.exitcode is None and watch.alive()
        ]

    def children(self) -> list[Any]:
        self._start_ended()
        return list(self.processes)


class _Producer(Protocol):
    """A producer's multiprocessing process, or an _Ended one."""

    @property
    def pid(self) -> int | None: ...
    @property
    def exitcode(self) -> int | None: ...
    @property
    def sentinel(self) -> int: ...
    def join(self, timeout: float | None = None) -> None: ...


class _Ended:
    """What a shut-down launcher keeps of a producer that ended: its pid and
    exit code. Its multiprocessing process is let go, off multiprocessing's
    children too (kept to the next start there), so that its descriptors
    (its sentinel; with fork, a pipe more) close now, not when the closed
    pipeline is collected: a job that keeps closed pipelines holds none.
    (A wait in another thread keeps the old list, its sentinels open.)"""

    __slots__ = ("pid", "exitcode")

    def __init__(self, p: _Producer) -> None:
        self.pid, self.exitcode = p.pid, p.exitcode
        children: set[Any] = getattr(multiprocessing.process, "_children", set())
        children.discard(p)

    @property
    def sentinel(self) -> int:
        raise ValueError(f"producer process {self.pid} was shut down: it has no sentinel")

    def join(self, timeout: float | None = None) -> None:
        """Ended and reaped already."""


def _pid(p: _Producer) -> int:
    pid = p.pid
    assert pid is not None  # a started process has one
    return pid


def prestart(objects: Sequence[Any]) -> None:
    """shmpipe.prestart(): the fork server started now, in the background,
    preloading what `objects` are made of (_startup.start_server); and what
    a first pipeline imports in this process, imported now."""
    # Born with SIGINT blocked, as when a pipeline starts it: so are the
    # producers it forks (born_with_ctrl_c_blocked says why).
    with born_with_ctrl_c_blocked("forkserver"):
        _startup.start_server(objects)
    # Meanwhile, what a first pipeline imports in this process: the default
    # transport's modules, and numpy.random, which draws the producers'
    # seeds (30 ms of that pipeline's first batch, measured, without
    # compiled bytecode), now rather than then.
    import numpy.random  # noqa: F401

    from shmpipe.registry import get_transport

    get_transport("shm")


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


def _wait_for_event(
    processes: Sequence[_Producer], watches: Sequence[ProcessWatch], readable: Sequence[Any], timeout: float
) -> None:
    """Waits up to `timeout` seconds for bytes on one of `readable` (objects
    with a fileno()) or the end of one of `processes` (returns at once if
    one has ended already). A process is waited on by its sentinel and,
    while it runs, its pidfd."""
    deadline = time.monotonic() + timeout
    waiting: list[Any] = [*readable]
    pidfds: dict[int, _Producer] = {}
    for p, watch in zip(processes, watches, strict=True):
        if isinstance(p, _Ended):
            return  # (in a thread that read the list as shutdown let go of them)
        waiting.append(p.sentinel)
        fd = watch.fileno()
        if fd is None:
            continue
        if watch.alive():
            pidfds[fd] = p
            waiting.append(fd)
        elif p.exitcode is not None:
            return  # ended (a sentinel a child holds would not say so)
    ready = multiprocessing.connection.wait(waiting, timeout)
    for p in [pidfds[fd] for fd in ready if isinstance(fd, int) and fd in pidfds]:
        if p.exitcode is None:
            _exit_code_soon(p, deadline)


def _join(p: _Producer, watch: ProcessWatch, deadline: float) -> None:
    """p.join() until `deadline` (monotonic), its end seen by its pidfd too
    (or by the watch, which keeps what it saw once its pidfd is closed)."""
    if watch.fileno() is not None:
        watch.wait(max(0.0, deadline - time.monotonic()))
    elif watch.alive():  # no pidfd (a zombie looks alive to kill(pid, 0)): the join tells its end
        p.join(max(0.0, deadline - time.monotonic()))
        return
    if watch.alive() or p.exitcode is not None:
        return  # still running at the deadline, or ended and reaped
    _exit_code_soon(p, deadline)


def _exit_code_soon(p: _Producer, deadline: float) -> None:
    """`p` has ended (its pidfd says so) and its exit code is not known yet:
    under the forkserver, p's parent, which writes it to p's sentinel once
    it has reaped p (a moment later). Waits for that, until `deadline`;
    not at all while that server is stopped: the status comes once it is
    continued, and each wait (a death found, its restart, the shutdown)
    would be GRACE_S lost. (Not for fork and spawn, where the exit code is
    known as soon as the pidfd says the process ended: there a join waits
    on a sentinel that a child of p may hold open.)"""
    if _forkserver.status_held_back(p):
        _forkserver.let_go(p)  # or the interpreter's exit would wait for the server
    else:
        p.join(max(0.0, deadline - time.monotonic()))


def _reap(processes: list[_Producer], watches: list[ProcessWatch]) -> None:
    """Gives the processes GRACE_S to exit, then SIGTERMs those still
    running and gives them GRACE_S, then SIGKILLs the rest and waits GRACE_S.
    A process stopped by a signal (SIGSTOP, Ctrl-Z) can neither exit nor act
    on a SIGTERM until it is continued: it is SIGKILLed at once instead of
    being waited for twice. Signals go through the watches (their pidfds):
    never to a process that took over the pid of one that ended."""
    for p, watch in zip(processes, watches, strict=True):
        # (Not atomic: one continued just after this look is killed all the
        # same; a producer has nothing to tidy that its consumer does not.)
        if p.exitcode is None and watch.alive() and process_stopped(_pid(p)):
            watch.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + GRACE_S
    for p, watch in zip(processes, watches, strict=True):
        _join(p, watch, deadline)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        # (One whose pidfd says it ended is not signalled or waited for
        # again: its exit code comes through the fork server, late where
        # that is stopped.)
        alive = [(p, w) for p, w in zip(processes, watches, strict=True) if p.exitcode is None and w.alive()]
        if not alive:
            break
        for _, watch in alive:
            watch.send_signal(sig)
        deadline = time.monotonic() + GRACE_S
        for p, watch in alive:
            _join(p, watch, deadline)
