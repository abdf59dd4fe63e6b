"""A flight recorder of gptpar's own collectives, and the dump a rank writes when a job hangs.

Every collective and point-to-point call gptpar issues runs inside `comm_span` (gptpar.parallel.comm), which also
tells RECORDER: each rank keeps the last CAPACITY of them (operation, its group's dimension name, bytes, step,
micro-step, start and end time, state) and, per group, how many it has entered (`seqs`). The ranks of a group issue
its collectives in one order, so the k-th collective of `dp` on one rank is the k-th on every other: a rank that
waits in `dp` #k while a peer's `dp` count is below k is waiting for a peer that never entered it. A pipeline's sends
and receives carry their `Peer` and count per channel (flight_format.channel: group, op, peer), since a rank's k-th
send to a peer is that peer's k-th receive from it. Each entry is also written as it is entered to the rank's
`Ledger` (job/rank<R>.ledger, a shared memory mapping), which outlives a rank that dies without dumping. Recording
costs a few list operations, two clock reads and a formatted line per call, and never waits for the device;
`make bench-step` measures it against a dp=2 step (docs/results.md). `Recorder.on` switches it off (the bench only).

A rank dumps (`dump`) its recorder to job/rank<R>.flight.json and the Python stack of every thread to
job/rank<R>.stack (gptpar.run.folder names them) when it fails inside a collective (a peer's timeout, say), and when
it receives DUMP_SIGNAL (SIGQUIT, the usual "dump your threads" signal: USR2 asks for a requeue, TERM and INT for a
stop, USR1 belongs to NCCL). A rank blocked inside a collective never runs a Python signal handler, so the signal
wakes a thread instead (`signal.set_wakeup_fd`), and faulthandler writes the stack at once from C to the rank's stderr
even if that thread cannot run. gptpar.run.hang reads every rank's dump and names the rank that held the others up.

While it trains, a thread of each rank rewrites its recorder's live state every second (job/rank<R>.live.json:
`live_state`), from which `gptpar status` tells a stuck run before parallel.timeout_s ends it (gptpar.run.hang.stuck).
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import math
import mmap
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple

import torch.distributed as dist

from gptpar.atomic import atomic_write_text
from gptpar.errors import GptparError
from gptpar.launchers import signal_job
from gptpar.parallel.env import DUMP_SIGNAL, own_job
from gptpar.parallel.flight_format import LEDGER_LINE, channel, ledger_line

CONT_WAIT_S = 0.05  # after the dump signal's byte, how long a SIGCONT's may take to follow (both come at once)
CAPTURE_WAIT_S = 1.0  # how long the dump waits for the main thread to capture itself (never, when blocked in C)
CAPTURE_POLL_S = 0.01
UNFINISHED = ("started", "waiting", "failed")  # states of a collective a rank has not come out of
STDERR_FD = 2


@dataclass
class _LiveTicks:
    """The live thread's last two rewrites (time.monotonic): a gap of PAUSED_AFTER_S between them, or since the last
    until now or until the thread `ended_at` (with the training: the rank winds down, running), says the process did
    not run (stopped or frozen); none while no live thread ran."""

    times: list[float] = field(default_factory=list)
    ended_at: float | None = None


_TICKS = _LiveTicks()
PAUSED_AFTER_S = 3.0
LIVE_EVERY_S = 1.0  # how often a rank rewrites its live state (gptpar.run.hang.LIVE_STALE_S reads it as stale after 3)
CAPACITY = 64  # collectives kept per rank: a step of bucketed dp issues a few per bucket; the hung one is the last
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # frames under it are shown relative to it: gptpar/train/...
# process group -> (its dimension's name, its global ranks); weak, so that naming a group does not keep it (and its
# gloo threads) alive once torch has destroyed it
_NAMES: weakref.WeakKeyDictionary[Any, tuple[str, list[int]]] = weakref.WeakKeyDictionary()
# Test only: RANK:STEP makes that rank skip its first gradient all-reduce of that step, a planted mismatch of the
# ranks' collectives that gptpar.run.hang must name (tests/e2e/test_hostile_signals.py). Never set it in a real run.
SKIP_COLLECTIVE_ENV = "GPTPAR_TEST_SKIP_COLLECTIVE"
_SKIPPED: set[tuple[int, int]] = set()


def name_group(group: dist.ProcessGroup | None, name: str) -> None:
    """Call `group` by its dimension's name (dp, tp, pp, ep, ...) in the recorder, with its members."""
    if group is not None:
        _NAMES[group] = (name, dist.get_process_group_ranks(group))


def group_name(group: dist.ProcessGroup | str | None) -> str:
    """The recorder's name of `group`: its dimension's (dp when dp spans the job: torch's mesh then hands out the
    default group), else `world` for the default group (None)."""
    if isinstance(group, str):
        return group
    if group in _NAMES:
        return _NAMES[group][0]
    return "world" if group is None or group is dist.GroupMember.WORLD else "group"


class Peer(NamedTuple):
    """The other end of a point-to-point call: its global rank, the message's bytes, and the pipeline micro-batch it
    belongs to."""

    rank: int
    nbytes: int
    micro_batch: int


class Recorder:
    """The last `capacity` collectives this rank entered (a ring), as plain dicts ready to be dumped. `on`: the one
    switch (off only to measure what recording costs: `make bench-step`)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.on = True
        self.entries: deque[dict[str, Any]] = deque(maxlen=capacity)
        # Collectives entered per group since the start (never wraps); a point-to-point call counts per channel
        # (flight_format.channel: group, op, peer), as its peer counts the matching op to this rank.
        self.seqs: Counter[str] = Counter()
        self.issued: dict[str, deque[dict[str, Any]]] = {}  # asynchronous ones issued and not yet waited for, by op
        self.ledger: Ledger | None = None  # where each entry is also written as it is entered (`mirrored`)
        self.step = 0
        self.micro_step = 0

    def new_step(self, step: int) -> None:
        self.step, self.micro_step = step, 0

    def enter(self, op: str, phase: str, group: str, nbytes: int, peer: Peer | None = None) -> dict[str, Any]:
        """The entry of a span starting now: a new collective (or a send or receive with `peer`), or for a wait the
        oldest `op` issued and not waited."""
        pending = self.issued.get(op)
        if phase == "wait" and pending:
            entry = pending.popleft()
            entry["state"] = "waiting"
            return entry
        key = group if peer is None else channel(group, op, peer.rank)
        self.seqs[key] += 1
        entry = {"seq": self.seqs[key], "op": op, "group": group, "bytes": nbytes, "step": self.step,
                 "micro_step": self.micro_step, "start": time.time(), "end": None,
                 "state": "waiting" if phase == "wait" else "started"}
        if peer is not None:
            entry.update(bytes=peer.nbytes, peer=peer.rank, micro_batch=peer.micro_batch)
        self.entries.append(entry)
        if self.ledger is not None:
            self.ledger.write(entry)
        return entry

    def leave(self, entry: dict[str, Any], phase: str, failed: bool = False) -> None:
        """The span of `entry` ended: an issue is now in flight, a call or a wait done (or failed)."""
        if failed:
            entry["state"] = "failed"
        elif phase == "issue":
            entry["state"] = "issued"
            self.issued.setdefault(entry["op"], deque(maxlen=self.entries.maxlen)).append(entry)
            return
        else:
            entry["state"] = "completed"
        entry["end"] = time.time()

    def blocked(self, entries: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
        """The collective or point-to-point call this rank is inside (or failed inside) and has not come out of: the
        oldest such."""
        return next((e for e in entries or self._entries() if e["state"] in UNFINISHED), None)

    def in_collective(self) -> bool:
        """Whether this rank is inside (or failed inside) any communication, point-to-point included."""
        return self.blocked() is not None

    def _entries(self) -> list[dict[str, Any]]:
        """The ring as a list, copied in one call: another thread (the dump's, the live state's) iterating the deque
        itself could see the main thread append to it."""
        return list(self.entries)

    def snapshot(self) -> dict[str, Any]:
        """The recorder as a dump holds it, with `blocked` for its reader (gptpar.run.hang)."""
        entries = self._entries()
        return {**self._position(entries), "entries": [dict(entry) for entry in entries]}

    def live(self) -> dict[str, Any]:
        """What the live state shows of the recorder (gptpar.run.hang.stuck reads it): the snapshot less the ring, with
        the last collective entered."""
        entries = self._entries()
        return {**self._position(entries), "last": dict(entries[-1]) if entries else None}

    def _position(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """Where the rank is, in a dump and in the live state alike: its step, counts and the call it is blocked in."""
        blocked = self.blocked(entries)
        return {"step": self.step, "micro_step": self.micro_step, "seqs": dict(self.seqs),
                "blocked": dict(blocked) if blocked else None}


class Ledger:
    """The recorder's ring mirrored into a file mapped into memory (job/rank<R>.ledger): what a rank entered outlives
    the rank where it dies without a dump (gloo aborts a rank whose collective does not match its peer's; SIGKILL).
    The n-th entry is one fixed-width line (flight_format.ledger_line) at slot n % capacity; the kernel keeps a
    shared mapping's writes when the process dies. About a microsecond per entry."""

    def __init__(self, path: Path, capacity: int) -> None:
        size = capacity * LEDGER_LINE
        with open(path, "wb") as out:
            out.truncate(size)
        with open(path, "r+b") as out:
            self.map = mmap.mmap(out.fileno(), size)
        self.capacity, self.n = capacity, 0

    def write(self, entry: dict[str, Any]) -> None:
        at = (self.n % self.capacity) * LEDGER_LINE
        self.map[at:at + LEDGER_LINE] = ledger_line(self.n, entry)
        self.n += 1

    def close(self) -> None:
        self.map.close()


RECORDER = Recorder()


@contextlib.contextmanager
def mirrored(path: Path) -> Iterator[None]:
    """While it runs, RECORDER's entries are also written to the ledger at `path` (gptpar.run.hang reads it for a rank
    that left no dump)."""
    RECORDER.ledger = Ledger(path, RECORDER.entries.maxlen or CAPACITY)
    try:
        yield
    finally:
        RECORDER.ledger.close()
        RECORDER.ledger = None


@functools.cache
def _planted_skip() -> tuple[int, int] | None:
    """SKIP_COLLECTIVE_ENV's (rank, step), read once; None where it is not set."""
    value = os.environ.get(SKIP_COLLECTIVE_ENV, "")
    if not value:
        return None
    rank, _, step = value.partition(":")
    if not (rank.isdigit() and step.isdigit()):
        raise GptparError(f"{SKIP_COLLECTIVE_ENV}={value!r}: expected RANK:STEP, two integers (a test-only switch)")
    return int(rank), int(step)


def skips_planted_collective() -> bool:
    """Whether this rank skips the gradient all-reduce it is about to issue: once, at SKIP_COLLECTIVE_ENV's step."""
    planted = _planted_skip()
    if planted is None or planted in _SKIPPED or planted != (dist.get_rank(), RECORDER.step):
        return False
    _SKIPPED.add(planted)
    return True


def _shown(filename: str) -> str:
    """A frame's file relative to the checkout (gptpar/train/trainer.py), else as Python named it."""
    path = Path(filename)
    return str(path.relative_to(PACKAGE_ROOT)) if path.is_relative_to(PACKAGE_ROOT) else filename


def frames(stack: traceback.StackSummary) -> list[list[Any]]:
    """[file, line, function] per frame, outermost first."""
    return [[_shown(f.filename), f.lineno, f.name] for f in stack]


def dump(rank: int, flight_path: Path, stack_path: Path, reason: str, stack: traceback.StackSummary,
         snapshot: dict[str, Any], stopped: bool = False, failure: str = "") -> None:
    """Write `snapshot` (the recorder's) and the main thread's `stack` to `flight_path`, and every thread's stack now
    to `stack_path` after `stack` itself. `failure`: the error a rank failed with inside a collective (`stack`: where
    it was raised); `stopped`: the rank had been stopped (SIGSTOP) until the dump signal came."""
    with open(stack_path, "a") as out:
        out.write(f"gptpar: rank {rank} pid {os.getpid()} at {time.time():.3f} ({reason})\n"
                  "The main thread:\n" + "".join(traceback.format_list(stack)) + (f"{failure}\n" if failure else "")
                  + "Every thread now:\n")
        out.flush()
        faulthandler.dump_traceback(out, all_threads=True)
    groups = {name: ranks for name, ranks in _NAMES.values()}
    atomic_write_text(flight_path, json.dumps({
        "rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "reason": reason,
        "stopped": stopped, "world_size": dist.get_world_size() if dist.is_initialized() else 1, "groups": groups,
        **snapshot, "frames": frames(stack)}) + "\n")


class _Dumper:
    """The dumps of one process. Each request (the dump signal) dumps: what the main thread captured of itself for it
    (`capture`, the moment it runs Python again, before it can fail), or, where it could not (blocked inside a
    collective), the recorder and its frames as the dumping thread takes them. A failure inside a collective dumps
    once and has the last word: no request overwrites it. So does the dump of a rank that a request continued
    (stopped until then, it runs on at once and fails in a later collective, far from where it hung, while the other
    ranks' requests still come): neither a failure nor a request overwrites it, and a failure waits for the answer to
    a request its main thread has seen."""

    def __init__(self, rank: int, flight_path: Path, stack_path: Path) -> None:
        self.rank, self.flight_path, self.stack_path = rank, flight_path, stack_path
        self.lock = threading.Lock()
        self.failed = self.continued = False  # a failure dumped; the last request's dump was of a stopped rank
        self.requests = self.answered = 0  # requests received (their bytes read) and answered, by the dump thread
        self.captures = 0  # requests the main thread's handler saw: the n-th capture is the n-th request's
        self.captured: tuple[int, dict[str, Any], traceback.StackSummary] | None = None

    def capture(self, frame: FrameType | None) -> None:
        self.captures += 1
        if frame is not None:  # one assignment: the dumping thread reads it without a lock
            self.captured = (self.captures, RECORDER.snapshot(), traceback.extract_stack(frame))

    def on_signal(self, stopped: bool) -> None:
        """Dump what the main thread captured for this request, or, where it could not, the recorder and its frames
        now (its capture comes later, when its collective ends, and is no later request's)."""
        self.requests += 1
        with self.lock:
            if not (self.failed or self.continued):
                deadline = time.monotonic() + CAPTURE_WAIT_S
                while ((captured := self.captured) is None or captured[0] < self.requests) and \
                        time.monotonic() < deadline:
                    time.sleep(CAPTURE_POLL_S)
                if captured is not None and captured[0] >= self.requests:
                    snapshot, stack = captured[1], captured[2]
                else:
                    main = sys._current_frames().get(threading.main_thread().ident or 0)
                    snapshot, stack = RECORDER.snapshot(), traceback.extract_stack(main)
                dump(self.rank, self.flight_path, self.stack_path, f"on request ({DUMP_SIGNAL.name})", stack,
                     snapshot, stopped)
                self.continued = stopped
            self.answered = self.requests

    def on_failure(self, exc: BaseException) -> bool:
        deadline = time.monotonic() + CONT_WAIT_S + CAPTURE_WAIT_S
        while self.captures > self.answered and time.monotonic() < deadline:  # a request seen, not yet answered
            time.sleep(CAPTURE_POLL_S)
        with self.lock:
            if self.failed or self.continued:
                return False
            self.failed = True
            dump(self.rank, self.flight_path, self.stack_path, "failed inside a collective",
                 traceback.extract_tb(exc.__traceback__), RECORDER.snapshot(), failure=f"{type(exc).__name__}: {exc}")
        return True


_dumper: _Dumper | None = None


def dump_on_failure(exc: BaseException) -> bool:
    """Dump this rank if it failed inside a collective (and has not dumped yet); whether it did."""
    return _dumper is not None and RECORDER.in_collective() and _dumper.on_failure(exc)


@contextlib.contextmanager
def dumps_on_signal(rank: int, flight_path: Path, stack_path: Path) -> Iterator[None]:
    """While it runs, DUMP_SIGNAL makes this rank dump (at most once), even when its main thread is blocked in a
    collective; and `dump_on_failure` dumps to the same files. Outside the main thread only the latter."""
    global _dumper
    dumper = _dumper = _Dumper(rank, flight_path, stack_path)
    if threading.current_thread() is not threading.main_thread():
        try:
            yield
        finally:
            _dumper = None
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = {DUMP_SIGNAL: signal.signal(DUMP_SIGNAL, lambda signum, frame: dumper.capture(frame)),
                signal.SIGCONT: signal.signal(signal.SIGCONT, _no_op)}  # for its byte on the wake-up fd
    previous_fd = signal.set_wakeup_fd(write)
    # At once from C, to the rank's stderr (job/rank<R>.err), even where no Python thread can run; then Python's handler
    faulthandler.register(DUMP_SIGNAL, file=STDERR_FD, all_threads=True, chain=True)
    thread = threading.Thread(target=_wait_for_signal, args=(read, dumper), name="gptpar-dump", daemon=True)
    thread.start()
    try:
        yield
    finally:
        faulthandler.unregister(DUMP_SIGNAL)
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.close(write)  # ends the thread's read
        thread.join()
        os.close(read)
        _dumper = None


@contextlib.contextmanager
def live_state(rank: int, path: Path, every_s: float = LIVE_EVERY_S) -> Iterator[None]:
    """While it runs, a thread rewrites `path` every `every_s` with this rank's recorder as `live` has it (the
    collective it waits in, if any, and its count per group), its pid and the time: `gptpar status` tells a stuck run
    from it (gptpar.run.hang.stuck) while the ranks wait, before parallel.timeout_s ends them. The training thread
    writes nothing, and a rank stopped (SIGSTOP) or frozen stops rewriting it. A rewrite holds the interpreter about
    0.1 ms (the state as JSON) and spends about 2.5 ms in file calls (median of 7 x 200 on the loaded 2-core CPU VM):
    0.01% of the training thread's second, under 0.3% of a core."""
    stop = threading.Event()
    _TICKS.times.clear()
    _TICKS.ended_at = None
    thread = threading.Thread(target=_write_live, args=(rank, path, every_s, stop), name="gptpar-live", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _write_live(rank: int, path: Path, every_s: float, stop: threading.Event) -> None:
    """Write the live state now, then every `every_s` until `stop`: a plain rename, no fsync (nobody needs it after a
    crash), and a failed write (a full disk) is skipped, never the rank's end."""
    host, pid = socket.gethostname(), os.getpid()
    while True:
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            groups = {name: ranks for name, ranks in _NAMES.values()}
            tmp.write_text(json.dumps({"rank": rank, "host": host, "pid": pid, "time": time.time(), "groups": groups,
                                       **RECORDER.live()}) + "\n")
            os.replace(tmp, path)
        except OSError:
            pass
        _TICKS.times[:] = [*_TICKS.times[-1:], time.monotonic()]
        if stop.wait(every_s):
            _TICKS.ended_at = time.monotonic()
            return


def _paused() -> bool:
    """Whether this process had not run for PAUSED_AFTER_S before now, by its live thread's rewrites (True where none
    ran: the dump signal's and SIGCONT's timing then decide alone). A rank asked while it winds down after training
    (a failed rank writing its own dump) is judged by its ticks until the live thread ended, not the wind-down's."""
    ticks = [*_TICKS.times, time.monotonic() if _TICKS.ended_at is None else _TICKS.ended_at]
    return len(ticks) == 1 or max(b - a for a, b in zip(ticks, ticks[1:], strict=False)) > PAUSED_AFTER_S


def _no_op(signum: int, frame: FrameType | None) -> None:
    """SIGCONT's Python handler: what counts is the byte the signal writes to the wake-up fd."""


def _wait_for_signal(read: int, dumper: _Dumper) -> None:
    """Dump when DUMP_SIGNAL's byte comes. A stopped rank gets SIGCONT after it (`request_dumps`), and the kernel
    delivers both at once (SIGCONT's first), so a SIGCONT's byte within CONT_WAIT_S of it says the rank was stopped; a
    running rank's SIGCONT comes later (a second signal from the launcher or scancel), or at once where two scancels
    land close together on a loaded node: the live thread's rewrites, which a stopped rank's lack, tell those apart."""
    continued = -math.inf
    while received := os.read(read, 64):
        if signal.SIGCONT in received:
            continued = time.monotonic()
        if DUMP_SIGNAL in received:
            if select.select([read], [], [], CONT_WAIT_S)[0] and signal.SIGCONT in os.read(read, 64):
                continued = time.monotonic()
            dumper.on_signal(time.monotonic() - continued < 2 * CONT_WAIT_S and _paused())


def request_dumps(env: Mapping[str, str]) -> bool:
    """Ask every rank of this job to dump (gptpar.launchers.signal_job): the dump signal, then SIGCONT, so that a rank
    stopped (SIGSTOP) runs again and dumps where it was stopped. False where nobody can be asked (torchrun,
    submitit's local executor) or the launcher or job is gone."""
    job = own_job(env)
    return job is not None and signal_job(*job, (DUMP_SIGNAL, signal.SIGCONT))
