"""How long the other ranks of a group take to hear that a rank died: the
time from a SIGKILL to each surviving rank's RankDiedError.

    python benchmarks/rank_death.py                  # 10 trials, 2 ranks, rank 1 killed
    python benchmarks/rank_death.py --victim 0       # rank 0 (the pipeline's) killed
    python benchmarks/rank_death.py --ranks 4 --trials 20 --backing posix --json death.json

Each trial starts a group of --ranks ranks as separate processes (this
script run again, each in a session of its own, all with one group name and
run_id=), fed by one pipeline on rank 0 (``from_iterators(group=...)``,
--sources producers of shmpipe.testing.sources.Counter, one batch every
--batch-delay-ms each, for longer than a trial lasts). Once every rank has
had --ready-after batches of pass 0, and a random wait of up to --jitter-ms
more, the driver reads CLOCK_MONOTONIC (``time.monotonic()``, one clock for
every process on Linux) and SIGKILLs the victim rank. Each surviving rank
reads the same clock first thing in its ``except RankDiedError``; the
difference is the latency reported. A rank takes the batches already dealt
to it before the error (each trial's line says how many it took after the
kill), so with a "training step" of --step-ms per batch the latency grows by
that many steps (about 5 with 2 ranks: --step-ms 50 gives some 260 ms); the
default 0 has the ranks wait in the pipeline most of the time, as a rank fed
slower than it trains does.

After each trial it checks that nothing is left: no process of the trial's
sessions (ranks, fork server, producers) within --cleanup-timeout, no
socket of the group's name in /proc/net/unix, and no shmpipe segment in
/dev/shm owned by a process of the trial (the default backing is a memfd,
which is never in /dev/shm; --backing posix puts the ring there). A trial
that leaves something, or fails (a wait past its timeout, a rank that ends
another way), is reported as such, and every process it started is ended.
Exit status 1 if any trial failed or left something.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from shmpipe._process import process_group_members
from shmpipe.testing.processes import gone

#: How often the driver looks at files and processes (it measures nothing
#: with this: the ranks read the clock themselves).
POLL_S = 0.002


# -- one rank (this script run with --rank-process CONFIG) -------------------------------


def _write_json(path: str, value: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def _end_with_the_driver(driver: int) -> None:
    """Ends this rank as soon as the driver (its parent) is gone, killed or
    not: a rank is in a session of its own, out of reach of the driver's
    process group, and its pipeline's producers and fork server end with it
    (they watch their consumer)."""
    while os.getppid() == driver:
        time.sleep(0.2)
    os._exit(1)


def _rank_process(cfg: dict[str, Any]) -> int:
    """One rank: iterates pass 0 of the group's pipeline until it fails;
    writes what happened (with the clock read at the error) to its report."""
    threading.Thread(target=_end_with_the_driver, args=(cfg["driver"],), daemon=True).start()
    t_error: float | None = None
    report: dict[str, Any] = {"rank": cfg["rank"], "pid": os.getpid(), "error": None, "batches": 0, "pids": []}
    taken: collections.deque[float] = collections.deque(maxlen=256)  # when the last batches came
    import shmpipe
    from shmpipe.testing.sources import Counter

    transport: Any = "shm"
    if cfg["backing"] == "posix":
        from shmpipe.transports.shm import ShmTransport

        transport = ShmTransport(backing="posix")
    pipe: Any = None
    try:
        pipe = shmpipe.from_iterators(
            [Counter(10**9, (cfg["floats"],), delay=cfg["batch_delay_ms"] / 1e3)] * cfg["sources"],
            transport=transport,
            start_method=cfg["start_method"],
            timeout=cfg["timeout"],
            group=cfg["group"],
            rank=cfg["rank"],
            num_ranks=cfg["num_ranks"],
            group_timeout=cfg["timeout"],
            run_id=cfg["run_id"],
        )
        report["pids"] = [p for p in pipe.pids if p is not None]
        for batch in pipe:
            taken.append(time.monotonic())
            del batch
            report["batches"] += 1
            if report["batches"] == cfg["ready_after"]:
                _write_json(cfg["ready_file"], {"pids": report["pids"]})
            if cfg["step_ms"]:
                time.sleep(cfg["step_ms"] / 1e3)
        report["error"] = ["none", "the pass ended"]
    except shmpipe.RankDiedError as exc:
        t_error = time.monotonic()
        report["error"] = [type(exc).__name__, str(exc)]
    except shmpipe.ShmpipeError as exc:
        t_error = time.monotonic()
        report["error"] = [type(exc).__name__, str(exc)]
    finally:
        report["t_error"] = t_error
        report["taken"] = list(taken)
        if pipe is not None and not pipe.closed:
            t0 = time.monotonic()
            pipe.close()
            report["close_s"] = time.monotonic() - t0
        _write_json(cfg["report_file"], report)
    return 0


# -- the driver ----------------------------------------------------------------------------------


def _in_sessions(sessions: set[int]) -> list[int]:
    """Live (not zombie) processes of these sessions: each rank's, which is
    also its process group (its fork server and producers stay in it)."""
    return [pid for session in sessions for pid in process_group_members(session)]


def _group_sockets(group: str) -> list[str]:
    """Sockets of the group's name (abstract namespace) in /proc/net/unix."""
    name = f"@shmpipe-group-{os.getuid()}-{group}"
    try:
        with open("/proc/net/unix") as f:
            return [line.split()[-1] for line in f if line.rstrip().endswith(name)]
    except OSError:
        return []


def _segments_of(pids: set[int]) -> list[str]:
    """shmpipe segments in /dev/shm whose owner (in the name) is one of `pids`."""
    from shmpipe._segments import SHM_DIR, parse_name

    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(e for e in entries if (owner := parse_name(e)) is not None and owner[0] in pids)


@dataclass
class Trial:
    trial: int
    victim: int
    group: str
    latencies_ms: dict[int, float] = field(default_factory=dict)  # survivor rank -> ms from the kill
    batches: dict[int, int] = field(default_factory=dict)  # each survivor's batches before the error
    after_kill: dict[int, int] = field(default_factory=dict)  # of them, taken after the kill
    errors: dict[int, list[str]] = field(default_factory=dict)
    processes: int = 0  # of the trial's sessions at the kill (ranks, fork servers, producers)
    cleanup_ms: float | None = None  # from the kill until no process of the trial is left
    failed: str | None = None
    left: list[str] = field(default_factory=list)
    logs: dict[int, str] = field(default_factory=dict)  # the ranks' output, of a trial that went wrong
    wall_s: float = 0.0


def _run_trial(i: int, args: argparse.Namespace, tmp: str, rng: random.Random) -> Trial:
    group = f"rd-{os.getpid()}-{i}-{uuid.uuid4().hex[:8]}"
    trial = Trial(i, args.victim, group)
    t_start = time.monotonic()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    seen: set[int] = set()  # every pid of the trial's sessions seen
    common = {
        "group": group, "num_ranks": args.ranks, "run_id": uuid.uuid4().hex, "sources": args.sources,
        "floats": args.floats, "batch_delay_ms": args.batch_delay_ms, "step_ms": args.step_ms,
        "ready_after": args.ready_after, "timeout": args.timeout, "backing": args.backing,
        "start_method": args.start_method, "driver": os.getpid(),
    }
    files = {r: (os.path.join(tmp, f"{group}-{r}.ready"), os.path.join(tmp, f"{group}-{r}.json"))
             for r in range(args.ranks)}

    def sessions() -> set[int]:
        return {p.pid for p in procs}

    def look() -> None:
        seen.update(_in_sessions(sessions()))

    def wait_until(what: str, done: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout:g} s")
            time.sleep(POLL_S)

    t_kill: float | None = None
    try:
        for r in range(args.ranks):
            cfg = {**common, "rank": r, "ready_file": files[r][0], "report_file": files[r][1]}
            log = open(os.path.join(tmp, f"{group}-{r}.log"), "w+b")  # closed below
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--rank-process", json.dumps(cfg)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            ))

        def all_ready() -> bool:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a rank ended before every rank had its first batches")
            return all(os.path.exists(files[r][0]) for r in range(args.ranks))

        wait_until("every rank's first batches", all_ready, args.start_timeout)
        time.sleep(rng.uniform(0.0, args.jitter_ms / 1e3))
        look()  # the producers and the fork server, before anything ends
        seen.update(p.pid for p in procs)
        trial.processes = len(seen)
        victim = procs[args.victim]
        t_kill = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        survivors = [r for r in range(args.ranks) if r != args.victim]
        wait_until("every survivor's report", lambda: all(os.path.exists(files[r][1]) for r in survivors),
                   args.timeout)
        for r in survivors:
            with open(files[r][1]) as f:
                report = json.load(f)
            trial.batches[r] = report["batches"]
            trial.after_kill[r] = sum(t > t_kill for t in report["taken"])
            trial.errors[r] = report["error"]
            if report["t_error"] is not None:
                trial.latencies_ms[r] = (report["t_error"] - t_kill) * 1e3
        wrong = {r: e for r, e in trial.errors.items() if e is None or e[0] != "RankDiedError"}
        if wrong:
            trial.failed = f"not a RankDiedError: {wrong}"
        for p in procs:
            p.wait(timeout=args.cleanup_timeout)
        if victim.returncode != -signal.SIGKILL:
            trial.failed = trial.failed or f"the victim ended with {victim.returncode}, not by SIGKILL"
        bad = {r: p.returncode for r, p in enumerate(procs) if r != args.victim and p.returncode != 0}
        if bad:
            trial.failed = trial.failed or f"survivors' exit codes: {bad}"
        try:
            wait_until("the trial's processes' end",
                       lambda: not _in_sessions(sessions()) and all(gone(p) for p in seen),
                       args.cleanup_timeout)
            trial.cleanup_ms = (time.monotonic() - t_kill) * 1e3
        except TimeoutError:
            pass  # reported below, as what is left
    except (TimeoutError, RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
        trial.failed = f"{type(exc).__name__}: {exc}"
    finally:
        # What is left of the trial (reported), then ended: every process of
        # its sessions, and every pid seen in them (one may have left them).
        left = sorted(set(_in_sessions(sessions())) | {p for p in seen if not gone(p)})
        for pid in left:
            trial.left.append(f"process {pid}")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                trial.left.append(f"rank process {p.pid} did not end after SIGKILL")
        for log in logs:
            log.close()
        trial.left += [f"socket {s}" for s in _group_sockets(group)]
        trial.left += [f"/dev/shm/{s}" for s in _segments_of(seen | sessions())]
        if trial.failed or trial.left:
            for r in range(args.ranks):
                path = os.path.join(tmp, f"{group}-{r}.log")
                with open(path, "rb") as log_file:
                    tail = log_file.read()[-1500:].decode(errors="replace").strip()
                if tail:
                    trial.logs[r] = tail
    trial.wall_s = time.monotonic() - t_start
    return trial


def _fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=2, help="ranks of each trial's group")
    parser.add_argument("--victim", type=int, default=1, help="the rank killed (default 1; 0: the pipeline's)")
    parser.add_argument("--sources", type=int, default=2, help="producers of the group's pipeline")
    parser.add_argument("--floats", type=int, default=1024, help="float32 values per batch")
    parser.add_argument("--batch-delay-ms", type=float, default=5.0, help="each producer's wait before a batch")
    parser.add_argument("--step-ms", type=float, default=0.0, help="each rank's 'training step' per batch")
    parser.add_argument("--ready-after", type=int, default=5, help="batches every rank has before the kill")
    parser.add_argument("--jitter-ms", type=float, default=100.0, help="a random wait of up to this, then the kill")
    parser.add_argument("--backing", choices=("memfd", "posix"), default="memfd", help="the ring's memory")
    parser.add_argument("--start-method", default=None, help="the producers' (default: shmpipe's, forkserver)")
    parser.add_argument("--timeout", type=float, default=20.0,
                        help="s: a rank's wait for a batch, the group's start, the survivors' reports after the kill")
    parser.add_argument("--start-timeout", type=float, default=60.0, help="s: every rank's first batches")
    parser.add_argument("--cleanup-timeout", type=float, default=15.0, help="s: every process of a trial gone")
    parser.add_argument("--seed", type=int, default=0, help="of the random waits before the kills")
    parser.add_argument("--json", metavar="FILE", help="also write every trial and the summary here")
    parser.add_argument("--rank-process", metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_process is not None:
        return _rank_process(json.loads(args.rank_process))
    if args.ranks < 2 or not 0 <= args.victim < args.ranks or args.trials < 1:
        parser.error("needs --ranks >= 2, 0 <= --victim < --ranks and --trials >= 1")

    # A SIGTERM or SIGHUP (the terminal closed) ends the run through the
    # trials' clean-up (SystemExit), as Ctrl-C does; the ranks end with this
    # process in any case (_end_with_the_driver).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    load = os.getloadavg()
    t0 = time.monotonic()
    print(f"rank death: {args.trials} trials, {args.ranks} ranks, rank {args.victim} killed (SIGKILL) "
          f"mid-pass; {args.sources} producers, a batch every {args.batch_delay_ms:g} ms each, step "
          f"{args.step_ms:g} ms, {args.backing} ring; {os.cpu_count()} CPUs, load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start", flush=True)
    rng = random.Random(args.seed)
    trials = []
    with tempfile.TemporaryDirectory(prefix="shmpipe-rank-death-") as tmp:
        for i in range(args.trials):
            t = _run_trial(i, args, tmp, rng)
            trials.append(t)
            survivors = ", ".join(f"rank {r} {_fmt(ms)} ms ({t.batches.get(r, '?')} batches, "
                                  f"{t.after_kill.get(r, '?')} after the kill)"
                                  for r, ms in sorted(t.latencies_ms.items())) or "-"
            problems = ([f"FAILED: {t.failed}"] if t.failed else []) + (
                [f"LEFT (ended now): {', '.join(t.left)}"] if t.left else [])
            status = "; ".join(problems) or "ok"
            print(f"trial {i:>2}: {survivors}; {t.processes} processes, all gone {_fmt(t.cleanup_ms)} ms after "
                  f"the kill; {t.wall_s:.1f} s; {status}", flush=True)
            for r, tail in t.logs.items():
                print(f"    rank {r}'s output: {tail}", flush=True)
    latencies = [ms for t in trials if not t.failed for ms in t.latencies_ms.values()]
    cleanups = [t.cleanup_ms for t in trials if t.cleanup_ms is not None and not t.failed]
    bad = [t for t in trials if t.failed or t.left]
    summary: dict[str, Any] = {"samples": len(latencies), "failed_or_left": len(bad)}
    print()
    print("| from the kill to | samples | min ms | median ms | max ms |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, values in (("each survivor's RankDiedError", latencies), ("every process of the trial gone", cleanups)):
        if values:
            row = {"min": min(values), "median": statistics.median(values), "max": max(values)}
            summary[name] = row
            print(f"| {name} | {len(values)} | {row['min']:.1f} | {row['median']:.1f} | {row['max']:.1f} |")
        else:
            print(f"| {name} | 0 | - | - | - |")
    example = next((e for t in trials for e in t.errors.values() if e), None)
    if example:
        print(f"\nthe error, e.g.: {example[0]}: {example[1]}")
    end_load = os.getloadavg()
    print(f"{len(trials) - len(bad)} of {len(trials)} trials clean; load average {load[0]:.2f} at the start, "
          f"{end_load[0]:.2f} at the end; {time.monotonic() - t0:.1f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "rank_process"},
                       "cpus": os.cpu_count(), "loadavg_start": load, "loadavg_end": end_load,
                       "trials": [asdict(t) for t in trials], "summary": summary}, f, indent=2)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
