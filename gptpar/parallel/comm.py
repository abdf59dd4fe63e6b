"""The profiler's names for communication: every collective and point-to-point call of the data-parallel
syncs and the pipeline engine runs inside `comm_span`, so a trace (`train.profile_steps`) shows when each
was issued and when a rank blocked on it, and `gptpar trace` (analysis/trace.py) can tell the two apart.

- phase "issue": an asynchronous call being started, `comm:<op>`;
- phase "wait": its `work.wait()`, `comm_wait:<op>`;
- phase "call": a blocking call, both spans at once (an issue waited for at once), so that matching the
  k-th issue of an op with its k-th wait holds even when blocking and asynchronous calls of one op interleave
  (a pipeline's loss all-reduce before the buckets' all-reduces).

Several ops issued by one call (a batch of sends and receives) get one span per op, nested. Without a
running profiler a span costs one check, its entry in the flight recorder (gptpar.parallel.flight: the group
and bytes a caller passes, for naming a hang) and, unless it is an issue, a DeviceClock (WAITING).

`SENT` counts the bytes this rank put on the wire by kind of collective, for the step record's `comm_bytes`: the
expert all-to-alls (gptpar.parallel.expert_parallel), counted from the actual split sizes, and our data-parallel
syncs' traffic (naive, bucketed, ddp, zero1, zero2, fsdp: `count_sent`, in ring terms; fsdp's gathers within a
node under parallel.hpz as `all_gather_intra`, apart from those that cross nodes). `SPENT` holds the spans of
device time inside timed collectives (`timed`: so far the expert all-to-alls), for its `comm_s`. `WAITING` holds the
spans this rank was blocked inside any span (a blocking call, or the wait for an asynchronous one; not an issue,
which returns at once; nested spans once), on the device's clock: the step's time less them is the rank's own compute
(the step record's `compute_s`), which sets a slow rank (a straggler) apart from the peers that wait for it. All three
start empty at each step's start (`new_step`), so an evaluation's traffic between steps counts in no step; WAITING
keeps nothing once the step's record has read it, until the next step starts.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import _profiler_enabled
from torch.profiler import record_function

from gptpar.clock import DeviceClock
from gptpar.parallel.flight import RECORDER, Peer, group_name
from gptpar.strategies.collectives import ring_share

PREFIXES = {"issue": ("comm",), "wait": ("comm_wait",), "call": ("comm", "comm_wait")}
SENT: Counter[str] = Counter()  # bytes sent to other ranks since the last read_sent(), by collective
SPENT: dict[str, list[DeviceClock]] = {}  # spans inside timed collectives since the last read_spent(), by collective


class Waiting:
    """The spans this rank spent blocked in gptpar's communication since its step began (`begin`) until the step's
    record took them (`read`), on `device`'s clock (CUDA events on the compute stream: a collective on NCCL's stream
    stalls it until done). Outside a step (an evaluation, a loop of the course's API) nothing is kept."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.clocks: list[DeviceClock] | None = None  # None: no step open
        self.inside = False  # in a timed span already: a nested one is not counted twice

    def begin(self, device: torch.device | None) -> None:
        """A step starts: keep its spans, on `device`'s clock (None: the last device's)."""
        self.device = device or self.device
        self.clocks = []

    def start(self, phase: str) -> DeviceClock | None:
        """The clock of a span starting now; None outside a step, for an issue (it does not block) or for a span
        inside a timed one."""
        if self.clocks is None or phase == "issue" or self.inside:
            return None
        self.inside = True
        return DeviceClock(self.device)

    def stop(self, clock: DeviceClock | None) -> None:
        """End the span that `start` returned `clock` for."""
        if clock is not None:
            clock.stop()
            self.inside = False
            if self.clocks is not None:
                self.clocks.append(clock)

    def read(self) -> list[DeviceClock]:
        """The step's spans, and none kept until the next step begins (read them with `DeviceClock.seconds` at the
        fetch)."""
        clocks, self.clocks = self.clocks or [], None
        return clocks


WAITING = Waiting()


def new_step(step: int = 0, device: torch.device | None = None) -> None:
    """Forget what was sent, spent and waited since the last step's record (an evaluation's traffic); `step` is the
    one starting, for the flight recorder; `device` the rank's, whose clock times its waits (unchanged: None)."""
    RECORDER.new_step(step)
    SENT.clear()
    SPENT.clear()
    WAITING.begin(device)


def count_sent(op: str, nbytes: int, group: dist.ProcessGroup | None) -> None:
    """Add this rank's ring share of an `op` of `nbytes` over `group` to SENT."""
    SENT[op] += ring_share(op, nbytes, dist.get_world_size(group))


def read_sent() -> dict[str, int]:
    """SENT's counts, then zero for the next step."""
    counts = dict(SENT)
    SENT.clear()
    return counts


def read_spent() -> dict[str, list[DeviceClock]]:
    """SPENT's spans, then none for the next step (read them with `DeviceClock.seconds` at the fetch)."""
    spans = dict(SPENT)
    SPENT.clear()
    return spans


@contextlib.contextmanager
def timed(op: str, device: torch.device, now: Callable[[], float] = time.perf_counter) -> Iterator[None]:
    """Count the device time of the enclosed collective in SPENT under `op` (`now`: DeviceClock's clock off a GPU)."""
    clock = DeviceClock(device, now)
    try:
        yield
    finally:
        clock.stop()
        SPENT.setdefault(op, []).append(clock)


@contextlib.contextmanager
def comm_span(*ops: str, phase: str = "call", group: dist.ProcessGroup | str | None = None,
              nbytes: int = 0, peers: Sequence[Peer] = ()) -> Iterator[None]:
    """Label the enclosed communication as `ops` (e.g. "all_reduce", "send") in the given phase, over `group` (None:
    the default group), `nbytes` the tensor's size, and record it in the flight recorder; `peers`, one per op, make
    them point-to-point calls (a send's receiver, a receive's sender, and the message's size)."""
    entries = _entered(ops, phase, group, nbytes, peers)
    clock = WAITING.start(phase)
    try:
        if not _profiler_enabled():
            yield
        else:
            with contextlib.ExitStack() as stack:
                for op in ops:
                    for prefix in PREFIXES[phase]:
                        stack.enter_context(record_function(f"{prefix}:{op}"))
                yield
    except BaseException:
        for entry in entries:
            RECORDER.leave(entry, phase, failed=True)
        raise
    finally:
        WAITING.stop(clock)
    for entry in entries:
        RECORDER.leave(entry, phase)


def gather_to_first(values: list[float], device: torch.device) -> list[list[float]] | None:
    """Every rank's `values` on rank 0, by rank (one gather of float64s over the job; every rank passes as many), in a
    span of its own; None on the other ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [list(values)]
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    with comm_span("gather", nbytes=tensor.nbytes):
        dist.gather(tensor, gathered, dst=0)
    return None if gathered is None else [t.tolist() for t in gathered]


def _entered(ops: tuple[str, ...], phase: str, group: dist.ProcessGroup | str | None, nbytes: int,
             peers: Sequence[Peer]) -> list[dict[str, Any]]:
    """The flight recorder's entries of a span's `ops` (none while it is off)."""
    if not RECORDER.on:
        return []
    name = group_name(group)
    return [RECORDER.enter(op, phase, name, nbytes, peer) for op, peer in zip(ops, peers or [None] * len(ops),
                                                                              strict=True)]


def labelled(op: str, collective: Callable[..., Any]) -> Callable[..., Any]:
    """`collective` (a torch.distributed call taking async_op) always inside its span: an issue when called
    with async_op=True, else a blocking call."""
    def call(*args: Any, async_op: bool = False, group: dist.ProcessGroup | None = None, **kwargs: Any) -> Any:
        with comm_span(op, phase="issue" if async_op else "call", group=group, nbytes=args[0].nbytes):
            return collective(*args, async_op=async_op, group=group, **kwargs)
    return call


# torch 2.13 renamed these collectives (the old names warn); older torch, down to the declared 2.4, has only the old.
all_gather = labelled("all_gather", getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)
reduce_scatter = labelled("reduce_scatter", getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)
