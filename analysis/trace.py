"""`gptpar trace`: where each rank's profiled steps went, from its Chrome trace (`train.profile_steps`).

The window is the union of the `ProfilerStep#<step>` spans the trainer puts around each profiled step
(the extent of the trace's events if it has none); every time below is clipped to it, and the wall
time is its length.

GPU traces (events of category "kernel", on the device's streams):
- communication: the union of the NCCL kernels' intervals (a kernel whose name contains "nccl");
- compute: the union of every other kernel's intervals;
- overlapped: the intersection of the two;
- idle: the window minus the union of all kernels.

CPU traces (gloo: no kernels), from the spans gptpar/parallel/comm.py puts around communication:
- a `comm:<op>` span issues an operation and a `comm_wait:<op>` span waits for one; per op, the k-th
  issue is matched with the k-th wait (both in order of start). A blocking call carries both spans at
  once. An issue left without a wait is a synchronous call, its own interval; a wait left without an
  issue (issued before the trace began) is its own interval too;
- communication (outstanding): the union over matched pairs of [issue start, wait end], of the
  unmatched spans, and of the `gloo:<op>` spans gloo's worker threads record while a collective runs
  (these also show the collectives of torch's DDP and FSDP2, which carry no gptpar spans; their waits
  inside backward count as compute, so their overlap is an upper bound);
- blocked: the union of the `comm_wait:*` spans and of the unmatched issue spans (time the rank could
  do nothing but wait);
- compute: the union of the `forward`, `backward`, `optimizer` and `forward_backward` spans minus blocked;
- overlapped: communication outstanding minus blocked, intersected with compute;
- idle: the window minus compute minus blocked.

The overlap share is overlapped / communication (None when a rank did not communicate). The top ops are
ranked by self time (an event's duration minus that of the events nested in it on the same thread),
summed by name over events that start in the window; the step spans themselves are left out.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptpar.errors import GptparError
from gptpar.run.folder import RunFolder
from gptpar.run.logfile import rank_of

Interval = tuple[float, float]  # [start, end) in microseconds, as the trace writes them

TRACE_FILE = re.compile(r"rank(\d+)\.json")
STEP_SPAN = re.compile(r"ProfilerStep#(\d+)")
COMPUTE_SPANS = ("forward", "backward", "optimizer", "forward_backward")
BACKEND_COMM = "gloo:"  # the spans gloo's worker threads record while they run a collective (torch's own too)
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
OP_CATEGORIES = ("cpu_op", "user_annotation", "cuda_runtime", *DEVICE_CATEGORIES)


# --- interval arithmetic on lists of [start, end) -----------------------------------------------------------

def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint, non-empty intervals covering the same points."""
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersection(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def difference(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The points of `a` not in `b`."""
    cuts = union(b)
    out, j = [], 0
    for start, end in union(a):
        while j < len(cuts) and cuts[j][1] <= start:
            j += 1
        at, k = start, j
        while k < len(cuts) and cuts[k][0] < end:
            if cuts[k][0] > at:
                out.append((at, cuts[k][0]))
            at = max(at, cuts[k][1])
            k += 1
        if at < end:
            out.append((at, end))
    return out


def length(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in union(intervals))


# --- reading traces ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Event:
    """A complete ("X") event of the trace."""

    name: str
    cat: str
    start: float
    end: float
    thread: tuple[Any, Any]  # (pid, tid): a process's thread, or a device's stream

    @property
    def interval(self) -> Interval:
        return self.start, self.end


@dataclass(frozen=True)
class TraceFile:
    events: list[Event]
    world_size: int | None  # torch's distributedInfo, written where torch.distributed ran (absent in one process)


def read_trace(path: Path) -> TraceFile:
    """A Chrome trace's complete events and world size; a file that is not one is a one-line GptparError naming it."""
    try:
        data = json.loads(path.read_bytes())
        raw = data["traceEvents"]
        events = [Event(str(e["name"]), str(e.get("cat", "")), float(e["ts"]), float(e["ts"]) + float(e["dur"]),
                        (e.get("pid"), e.get("tid"))) for e in raw if e.get("ph") == "X"]
        world = (data.get("distributedInfo") or {}).get("world_size")
        return TraceFile(events, int(world) if world is not None else None)
    except OSError as exc:
        raise GptparError(f"cannot read {path} ({exc.strerror or exc})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise GptparError(f"{path} is not a readable Chrome trace (truncated or corrupt: "
                          f"{type(exc).__name__})") from None


def trace_files(run_dir: Path) -> list[tuple[int, Path]]:
    """(rank, path) of every trace/rank<R>.json, by rank; none is a one-line GptparError."""
    folder = RunFolder(run_dir).trace_dir
    found = sorted((int(m.group(1)), p) for p in folder.glob("rank*.json") if (m := TRACE_FILE.fullmatch(p.name)))
    if not found:
        raise GptparError(f"no traces in {folder} (train with train.profile_steps=A-B, e.g. 3-5)")
    return found


# --- the breakdown ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HtaRank:
    """Holistic Trace Analysis's figures for one rank (analysis/holistic.py): times in seconds over its window, shares
    in percent as HTA rounds them."""

    window_s: float
    idle_s: float
    compute_s: float
    non_compute_s: float
    idle_pct: float
    compute_pct: float
    non_compute_pct: float
    overlap_pct: float | None  # None where the rank ran no NCCL kernel

    @property
    def overlap_share(self) -> float | None:
        return self.overlap_pct / 100 if self.overlap_pct is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {"window_s": self.window_s, "idle_s": self.idle_s, "compute_s": self.compute_s,
                "non_compute_s": self.non_compute_s, "idle_pct": self.idle_pct, "compute_pct": self.compute_pct,
                "non_compute_pct": self.non_compute_pct, "overlap_pct": self.overlap_pct}


@dataclass(frozen=True)
class RankTrace:
    """One rank's profiled steps: times in seconds (see the module doc for their definitions)."""

    rank: int
    mode: str  # "gpu" (from kernels) or "cpu" (from the communication spans)
    steps: list[int]
    wall_s: float
    compute_s: float
    comm_s: float
    overlap_s: float
    idle_s: float
    top_ops: list[dict[str, Any]] = field(default_factory=list)  # name, where (cpu/gpu), self_s, calls
    hta: HtaRank | None = None  # Holistic Trace Analysis's figures, where it read this rank (analysis/holistic.py)

    @property
    def own_overlap_share(self) -> float | None:
        """gptpar's: overlapped / communication (None when the rank did not communicate)."""
        return self.overlap_s / self.comm_s if self.comm_s > 0 else None

    @property
    def overlap_share(self) -> float | None:
        """HTA's where it computed one (GPU traces), else gptpar's."""
        return self.hta.overlap_share if self.hta is not None else self.own_overlap_share

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "mode": self.mode, "steps": self.steps, "wall_s": self.wall_s,
                "compute_s": self.compute_s, "comm_s": self.comm_s, "overlap_s": self.overlap_s,
                "idle_s": self.idle_s, "overlap_share": self.overlap_share,
                "gptpar_overlap_share": self.own_overlap_share, "top_ops": self.top_ops,
                "hta": self.hta.to_dict() if self.hta is not None else None}


def window(events: list[Event]) -> tuple[list[Interval], list[int]]:
    """The profiled steps' window and their numbers."""
    steps = [(e, int(m.group(1))) for e in events if e.cat != "gpu_user_annotation"
             and (m := STEP_SPAN.fullmatch(e.name))]
    if steps:
        return union(e.interval for e, _ in steps), sorted(n for _, n in steps)
    return union([(min(e.start for e in events), max(e.end for e in events))] if events else []), []


def gpu_breakdown(events: list[Event], span: list[Interval]) -> tuple[float, float, float, float]:
    """(compute, communication, overlapped, idle) in microseconds, from the kernels."""
    kernels = [e for e in events if e.cat == "kernel"]
    comm = intersection((e.interval for e in kernels if "nccl" in e.name.lower()), span)
    compute = intersection((e.interval for e in kernels if "nccl" not in e.name.lower()), span)
    return (length(compute), length(comm), length(intersection(compute, comm)),
            length(difference(span, [*compute, *comm])))


def comm_intervals(events: list[Event]) -> tuple[list[Interval], list[Interval]]:
    """(outstanding, blocked) from the comm:<op> and comm_wait:<op> spans, matched in order per op."""
    issues: dict[str, list[Interval]] = defaultdict(list)
    waits: dict[str, list[Interval]] = defaultdict(list)
    for e in events:
        kind, _, op = e.name.partition(":")
        if e.cat != "gpu_user_annotation" and kind in ("comm", "comm_wait"):
            (issues if kind == "comm" else waits)[op].append(e.interval)
    outstanding, blocked = [], []
    for op in issues.keys() | waits.keys():
        started, waited = sorted(issues[op]), sorted(waits[op])
        outstanding += [(issue[0], wait[1]) for issue, wait in zip(started, waited, strict=False)]
        synchronous = started[len(waited):]
        outstanding += synchronous + waited[len(started):]
        blocked += synchronous + waited
    return union(outstanding), union(blocked)


def cpu_breakdown(events: list[Event], span: list[Interval]) -> tuple[float, float, float, float]:
    """(compute, communication, overlapped, idle) in microseconds, from the record_function spans."""
    outstanding, blocked = comm_intervals(events)
    running = (e.interval for e in events if e.name.startswith(BACKEND_COMM))
    outstanding, blocked = intersection([*outstanding, *running], span), intersection(blocked, span)
    work = (e.interval for e in events if e.name in COMPUTE_SPANS and e.cat != "gpu_user_annotation")
    compute = difference(intersection(work, span), blocked)
    overlapped = intersection(difference(outstanding, blocked), compute)
    return (length(compute), length(outstanding), length(overlapped),
            length(difference(span, [*compute, *blocked])))


def top_ops(events: list[Event], span: list[Interval], n: int) -> list[dict[str, Any]]:
    """The n ops with the most self time, summed by name over the events that start in the window."""
    by_thread: dict[tuple[Any, Any], list[Event]] = defaultdict(list)
    for e in events:
        if e.cat in OP_CATEGORIES:
            by_thread[e.thread].append(e)
    self_time: dict[tuple[str, str], float] = defaultdict(float)
    calls: Counter[tuple[str, str]] = Counter()
    for thread in by_thread.values():
        for e, own in _self_times(thread):
            if not STEP_SPAN.fullmatch(e.name) and any(lo <= e.start < hi for lo, hi in span):
                key = (e.name, "gpu" if e.cat in DEVICE_CATEGORIES else "cpu")
                self_time[key] += own
                calls[key] += 1
    ranked = sorted(self_time, key=lambda key: -self_time[key])[:n]
    return [{"name": name, "where": where, "self_s": self_time[(name, where)] / 1e6, "calls": calls[(name, where)]}
            for name, where in ranked]


def _self_times(thread: list[Event]) -> list[tuple[Event, float]]:
    """Each event with its duration minus its direct children's (events nested in it on the thread)."""
    ordered = sorted(thread, key=lambda e: (e.start, -e.end))
    children = [0.0] * len(ordered)
    stack: list[int] = []
    for i, e in enumerate(ordered):
        while stack and ordered[stack[-1]].end <= e.start:
            stack.pop()
        if stack:
            children[stack[-1]] += min(e.end, ordered[stack[-1]].end) - e.start
        stack.append(i)
    return [(e, e.end - e.start - kids) for e, kids in zip(ordered, children, strict=True)]


def analyse(rank: int, events: list[Event], top: int = 10) -> RankTrace:
    span, steps = window(events)
    gpu = any(e.cat == "kernel" for e in events)
    compute, comm, overlap, idle = (gpu_breakdown if gpu else cpu_breakdown)(events, span)
    return RankTrace(rank, "gpu" if gpu else "cpu", steps, length(span) / 1e6, compute / 1e6, comm / 1e6,
                     overlap / 1e6, idle / 1e6, top_ops(events, span, top))


def analyse_run(run_dir: Path, top: int = 10) -> tuple[list[RankTrace], list[str]]:
    """Every rank's breakdown, and one line for each trace file that could not be read and for ranks without one."""
    ranks, skipped, worlds, files = [], [], set(), trace_files(run_dir)
    for rank, path in files:
        try:
            trace = read_trace(path)
        except GptparError as exc:
            skipped.append(f"skipped: {exc}")
            continue
        ranks.append(analyse(rank, trace.events, top))
        worlds.add(trace.world_size or 0)
    missing = missing_ranks(run_dir, {rank for rank, _ in files}, max(worlds, default=0))
    return ranks, skipped + ([missing] if missing else [])


def missing_ranks(run_dir: Path, traced: set[int], world_size: int) -> str | None:
    """One line naming the ranks that ran (the traces' world size, the run's rank logs) but left no trace file."""
    folder = RunFolder(run_dir)
    ran = set(range(world_size)) | {rank for p in folder.rank_logs() if (rank := rank_of(p)) is not None}
    if not ran - traced:
        return None
    return (f"missing: the run had {max(ran) + 1} ranks and {folder.trace_dir} holds traces for rank "
            f"{_ranks(traced)} only (none for {_ranks(ran - traced)})")


def _ranks(ranks: set[int]) -> str:
    return ", ".join(map(str, sorted(ranks)))


# --- output -----------------------------------------------------------------------------------------------

def _steps(steps: list[int]) -> str:
    if not steps:
        return "-"
    return str(steps[0]) if steps[0] == steps[-1] else f"{steps[0]}-{steps[-1]}"


def table(ranks: list[RankTrace], section: str = "") -> str:
    """Per rank: the breakdown in milliseconds and the overlap share (HTA's where it read the rank), a section
    (HTA's own table), then each rank's top ops."""
    lines = [f"{'rank':>4}  {'mode':4}  {'steps':>6}  {'wall ms':>9}  {'compute':>9}  {'comm':>9}  "
             f"{'overlap':>9}  {'idle':>9}  {'overlap share':>13}"]
    for r in ranks:
        share = f"{r.overlap_share:.1%}" if r.overlap_share is not None else "n/a"
        lines.append(f"{r.rank:>4}  {r.mode:4}  {_steps(r.steps):>6}  "
                     + "  ".join(f"{t * 1e3:>9.2f}" for t in (r.wall_s, r.compute_s, r.comm_s, r.overlap_s,
                                                               r.idle_s)) + f"  {share:>13}" + ("*" if r.hta else ""))
    if any(r.hta for r in ranks):
        lines.append("* Holistic Trace Analysis's overlap share (gptpar's own beside it below)")
    if section:
        lines += ["", section]
    for r in ranks:
        if r.top_ops:
            lines += ["", f"rank {r.rank}: top {len(r.top_ops)} ops by self time",
                      f"  {'self ms':>9}  {'calls':>6}  where  op"]
            lines += [f"  {op['self_s'] * 1e3:>9.2f}  {op['calls']:>6}  {op['where']:5}  {op['name'][:100]}"
                      for op in r.top_ops]
    return "\n".join(lines)
